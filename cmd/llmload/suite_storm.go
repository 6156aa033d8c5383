package main

import (
	"context"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// StormReport is S6: three mock replicas each failing a share of requests
// (503 before any byte), swept from 0 to 100%, and what each target sends
// upstream per client request — its retry amplification.
type StormReport struct {
	Config   SuiteConfig `json:"config"`
	Upstream string      `json:"upstream"`
	Rates    []float64   `json:"error_rates"`
	// Rate is the offered load in requests per second (open loop: a
	// request starts every 1/Rate s whatever the others do, as clients
	// keep sending during an outage) for Duration at each error rate.
	Rate     float64       `json:"requests_per_s"`
	Duration time.Duration `json:"duration_ns"`
	Started  time.Time     `json:"started"`
	Targets  []StormTarget `json:"targets"`
	// BudgetRatio and BudgetFloor are llm_proxy's default retry budget
	// (retries ≤ ratio × requests, plus a floor of retries per second
	// holding one second of it), from which the attempts target of a
	// point is computed (StormPoint.Bound).
	BudgetRatio float64 `json:"budget_ratio"`
	BudgetFloor float64 `json:"budget_floor_per_s"`
}

// Defaults of llm_proxy's retry budget (budget.DefaultRatio,
// budget.DefaultMinPerSec), the S6 attempts target.
const (
	stormBudgetRatio = 0.1
	stormBudgetFloor = 3.0
)

// stormServedSlack is the served target's allowance: llm_proxy serves at
// least what direct serves, less this many points, at every error rate
// (issue 19).
const stormServedSlack = 5.0

// StormTarget is one target's sweep, in the order the rates were run (the
// target's breakers and budgets carry from one rate to the next, as in an
// outage that grows).
type StormTarget struct {
	Name   string       `json:"name"`
	Points []StormPoint `json:"points"`
}

// StormPoint is one error rate.
type StormPoint struct {
	Rate     float64 `json:"error_rate"`
	Requests int64   `json:"requests"`
	OK       int64   `json:"ok"`
	// Outcomes counts the client's outcomes (ok, http_503, ...).
	Outcomes map[string]int64 `json:"outcomes"`
	// Upstream is the completion requests the mock fleet received;
	// PerRequest is Upstream ÷ Requests, the amplification.
	Upstream   int64   `json:"upstream_attempts"`
	PerRequest float64 `json:"attempts_per_request"`
	// Bound is the attempts per request that llm_proxy's default retry
	// budget allows at this point: 1 + ratio × (requests + the previous
	// rate's requests) ÷ requests + floor × (1 + duration in seconds) ÷
	// requests. The rates follow each other within the budget's 10 s
	// window, so the previous rate's requests still earn retries here;
	// the floor holds one second of retries and earns its rate per second.
	Bound float64 `json:"attempts_bound"`
}

// Served is the share of requests that succeeded, in percent.
func (p StormPoint) Served() float64 { return pct(p.OK, p.Requests) }

// stormGoals judges llm_proxy's sweep against direct's, rate by rate: the
// served target (served ≥ direct − 5 points) and the attempts target
// (attempts per request ≤ Bound). known is false when either sweep is
// missing; the verdicts are per rate, in the order of r.Rates.
func stormGoals(r *StormReport) (served, attempts []bool, known bool) {
	var direct, llm *StormTarget
	for i := range r.Targets {
		switch r.Targets[i].Name {
		case TargetDirect:
			direct = &r.Targets[i]
		case TargetLLMProxy:
			llm = &r.Targets[i]
		}
	}
	if direct == nil || llm == nil || len(llm.Points) == 0 || len(direct.Points) != len(llm.Points) {
		return nil, nil, false
	}
	for i, pt := range llm.Points {
		served = append(served, pt.Served() >= direct.Points[i].Served()-stormServedSlack)
		attempts = append(attempts, pt.Bound > 0 && pt.PerRequest <= pt.Bound)
	}
	return served, attempts, true
}

func runStormScenario(ctx context.Context, cfg *SuiteConfig) (*StormReport, error) {
	rep := &StormReport{Config: *cfg, Rates: []float64{0, 0.25, 0.5, 0.75, 1}, Rate: 50, Duration: 4 * time.Second,
		Started: time.Now(), Upstream: "3 mock replicas, TTFT 0, 2 tokens; a failing attempt gets 503 before any byte (X-Mock-Fault: status=503,fraction=F)",
		BudgetRatio: stormBudgetRatio, BudgetFloor: stormBudgetFloor}
	if cfg.Smoke {
		// 100 requests a point: direct's share then varies by ±5 points.
		rep.Rates, rep.Duration = []float64{0, 0.5, 1}, 2*time.Second
	}
	client := newHTTPClient(64)
	for _, t := range cfg.Targets {
		url := t.StormURL
		if url == "" {
			if t.Name != TargetDirect {
				continue
			}
			url = t.URL // direct: one replica, no one to retry
		}
		st := StormTarget{Name: t.Name}
		var prev int64
		for _, rate := range rep.Rates {
			if ctx.Err() != nil {
				break
			}
			pt, err := runStormPoint(ctx, client, cfg, url, rate, rep.Rate, rep.Duration, prev)
			if err != nil {
				return nil, fmt.Errorf("%s at error rate %g: %w", t.Name, rate, err)
			}
			suiteLog("S6 %s: error rate %3.0f%%: %.2f upstream attempts per request, %d/%d ok",
				t.Name, 100*rate, pt.PerRequest, pt.OK, pt.Requests)
			st.Points = append(st.Points, pt)
			prev = pt.Requests
		}
		rep.Targets = append(rep.Targets, st)
	}
	return rep, nil
}

// stormFault is the X-Mock-Fault header for an error rate.
func stormFault(rate float64) string {
	switch {
	case rate <= 0:
		return "none"
	case rate >= 1:
		return "status=503"
	}
	return "status=503,fraction=" + strconv.FormatFloat(rate, 'g', -1, 64)
}

func runStormPoint(ctx context.Context, hc *http.Client, cfg *SuiteConfig, url string, rate, perSec float64, d time.Duration, prev int64) (StormPoint, error) {
	pt := StormPoint{Rate: rate, Outcomes: map[string]int64{}}
	// Nothing of the previous point may still be in flight when the counts
	// are reset.
	if err := waitFleetIdle(ctx, hc, []string{cfg.Mock}, 10*time.Second); err != nil {
		return pt, err
	}
	if err := resetMock(ctx, hc, cfg.Mock); err != nil {
		return pt, err
	}
	h := mockHeaders(0, 2, 0)
	h.Set("X-Mock-Fault", stormFault(rate))
	q := &Requester{Client: hc, URL: url + "/v1/chat/completions", Body: chatBody("mock-llama", true, 0, 0),
		Header: h, Timeout: cfg.Timeout}
	for _, r := range runOpenLoop(ctx, q, perSec, d) {
		pt.Requests++
		pt.Outcomes[r.Outcome]++
		if r.OK() {
			pt.OK++
		}
	}
	if err := waitFleetIdle(ctx, hc, []string{cfg.Mock}, 10*time.Second); err != nil {
		return pt, err
	}
	fs, err := fetchMock(ctx, hc, cfg.Mock)
	if err != nil {
		return pt, err
	}
	pt.Upstream = summarizeMock(cfg.Mock, fs).Requests
	if pt.Requests > 0 {
		pt.PerRequest = float64(pt.Upstream) / float64(pt.Requests)
		n := float64(pt.Requests)
		pt.Bound = 1 + stormBudgetRatio*(n+float64(prev))/n + stormBudgetFloor*(1+d.Seconds())/n
	}
	return pt, nil
}

// runOpenLoop starts a request every 1/perSec for d and returns the results
// of all of them once they have ended.
func runOpenLoop(ctx context.Context, q *Requester, perSec float64, d time.Duration) []Result {
	n := int(perSec * d.Seconds())
	results := make([]Result, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		if wait := time.Until(start.Add(time.Duration(float64(i) / perSec * float64(time.Second)))); wait > 0 {
			sleepCtx(ctx, wait)
		}
		if ctx.Err() != nil {
			break
		}
		wg.Go(func() { results[i] = q.Do(ctx) })
	}
	wg.Wait()
	out := results[:0]
	for _, r := range results {
		if r.Outcome != "" {
			out = append(out, r)
		}
	}
	return out
}
