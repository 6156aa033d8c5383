package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Gateway metric names that the summary reads.
const (
	metricPrefix   = "caddy_llm_proxy_"
	metricRequests = "caddy_llm_proxy_requests_total"
	metricAttempts = "caddy_llm_proxy_upstream_attempts_total"
	metricTTFT     = "caddy_llm_proxy_ttft_seconds"
	metricHedges   = "caddy_llm_proxy_hedges_total"
	metricDelay    = "caddy_llm_proxy_hedge_delay_seconds"
	metricRetries  = "caddy_llm_proxy_retries_total"
	metricBudget   = "caddy_llm_proxy_retry_budget_exhausted_total"
)

// Series is one sample of the Prometheus text exposition format.
type Series struct {
	Name   string
	Labels map[string]string
	Value  float64
}

// Scrape maps a series key (name and sorted labels) to its sample.
type Scrape map[string]Series

// scrapeMetrics fetches url and returns the series whose names start with
// prefix.
func scrapeMetrics(ctx context.Context, client *http.Client, url, prefix string) (Scrape, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	// Ask for the text format; Prometheus handlers may otherwise negotiate
	// protobuf or OpenMetrics.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("scrape %s: status %d", url, resp.StatusCode)
	}
	s, err := parseExposition(resp.Body, prefix)
	if err != nil {
		return nil, fmt.Errorf("scrape %s: %w", url, err)
	}
	return s, nil
}

// parseExposition parses the Prometheus text format, keeping the series
// whose names start with prefix.
func parseExposition(r io.Reader, prefix string) (Scrape, error) {
	out := Scrape{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' || !strings.HasPrefix(line, prefix) {
			continue
		}
		s, err := parseSeries(line)
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out[seriesKey(s.Name, s.Labels)] = s
	}
	return out, sc.Err()
}

// parseSeries parses `name{k="v",...} value [timestamp]`.
func parseSeries(line string) (Series, error) {
	s := Series{Labels: map[string]string{}}
	i := strings.IndexAny(line, "{ \t")
	if i < 0 {
		return s, fmt.Errorf("no value in %q", line)
	}
	s.Name, line = line[:i], line[i:]
	if line[0] == '{' {
		line = line[1:]
		for {
			line = strings.TrimLeft(line, " \t,")
			if line == "" {
				return s, fmt.Errorf("unterminated labels in series %s", s.Name)
			}
			if line[0] == '}' {
				line = line[1:]
				break
			}
			eq := strings.IndexByte(line, '=')
			if eq < 0 || len(line) < eq+2 || line[eq+1] != '"' {
				return s, fmt.Errorf("bad label in series %s", s.Name)
			}
			name := strings.TrimSpace(line[:eq])
			line = line[eq+2:]
			var v strings.Builder
			closed := false
			for j := 0; j < len(line); j++ {
				c := line[j]
				if c == '\\' && j+1 < len(line) {
					j++
					switch line[j] {
					case 'n':
						v.WriteByte('\n')
					default:
						v.WriteByte(line[j])
					}
					continue
				}
				if c == '"' {
					line, closed = line[j+1:], true
					break
				}
				v.WriteByte(c)
			}
			if !closed {
				return s, fmt.Errorf("unterminated label value in series %s", s.Name)
			}
			s.Labels[name] = v.String()
		}
	}
	fields := strings.Fields(line)
	if len(fields) == 0 {
		return s, fmt.Errorf("no value in series %s", s.Name)
	}
	v, err := strconv.ParseFloat(fields[0], 64)
	if err != nil {
		return s, fmt.Errorf("series %s: %w", s.Name, err)
	}
	s.Value = v
	return s, nil
}

func seriesKey(name string, labels map[string]string) string {
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	b.WriteString(name)
	for _, k := range keys {
		fmt.Fprintf(&b, ",%s=%q", k, labels[k])
	}
	return b.String()
}

// Delta returns after − before for every series in after (a series absent
// before counts from 0).
func Delta(before, after Scrape) Scrape {
	out := Scrape{}
	for k, s := range after {
		d := s
		d.Value -= before[k].Value
		out[k] = d
	}
	return out
}

// AttemptCount is the number of upstream attempts with one outcome.
type AttemptCount struct {
	Upstream string  `json:"upstream"`
	Outcome  string  `json:"outcome"`
	Count    float64 `json:"count"`
}

// GatewayDelta is what the gateway counted during a run.
type GatewayDelta struct {
	// Found is false when the scrape had no caddy_llm_proxy_* series.
	Found bool `json:"found"`
	// Requests counts requests by outcome, summed over upstream and model.
	Requests      map[string]float64 `json:"requests_by_outcome"`
	RequestsTotal float64            `json:"requests_total"`
	// Attempts is sorted by upstream, then outcome.
	Attempts      []AttemptCount `json:"attempts"`
	AttemptsTotal float64        `json:"attempts_total"`
	// Failovers is attempts − the requests that made one: attempts that
	// followed another attempt of the same request (requests refused before
	// any upstream — circuit_open, no_upstream, refused, invalid_request —
	// made none).
	Failovers float64 `json:"failovers"`
	// TTFT quantiles estimated from the histogram buckets (0: no data).
	TTFTCount float64 `json:"ttft_count"`
	TTFTP50   float64 `json:"ttft_p50_ms"`
	TTFTP99   float64 `json:"ttft_p99_ms"`
	// Hedges counts hedges by outcome: fired (a backup started), won (the
	// backup committed), lost (the primary committed), suppressed (a gate
	// refused the backup: breaker, hedge-rate cap, retry budget, attempts).
	Hedges map[string]float64 `json:"hedges_by_outcome,omitempty"`
	// Retries counts retries (pre-commit failovers), BudgetExhausted the
	// retries the retry budget refused.
	Retries         float64 `json:"retries"`
	BudgetExhausted float64 `json:"retry_budget_exhausted"`
	// HedgeDelayMS is the hedge delay the gateway last computed, read from
	// the gauge at the end of the run (the highest over models); 0 without
	// hedging.
	HedgeDelayMS float64 `json:"hedge_delay_ms,omitempty"`
}

// gatewayDelta interprets the delta of two scrapes.
func gatewayDelta(d Scrape) GatewayDelta {
	g := GatewayDelta{Requests: map[string]float64{}}
	attempts := map[[2]string]float64{}
	var buckets []bucket
	byLE := map[float64]float64{}
	for _, s := range d {
		switch s.Name {
		case metricRequests:
			g.Found = true
			g.Requests[s.Labels["outcome"]] += s.Value
			g.RequestsTotal += s.Value
		case metricAttempts:
			g.Found = true
			attempts[[2]string{s.Labels["upstream"], s.Labels["outcome"]}] += s.Value
			g.AttemptsTotal += s.Value
		case metricTTFT + "_bucket":
			g.Found = true
			le, err := strconv.ParseFloat(s.Labels["le"], 64)
			if err == nil {
				byLE[le] += s.Value
			}
		case metricTTFT + "_count":
			g.TTFTCount += s.Value
		case metricHedges:
			g.Found = true
			if g.Hedges == nil {
				g.Hedges = map[string]float64{}
			}
			g.Hedges[s.Labels["outcome"]] += s.Value
		case metricRetries:
			g.Found = true
			g.Retries += s.Value
		case metricBudget:
			g.Found = true
			g.BudgetExhausted += s.Value
		default:
			if strings.HasPrefix(s.Name, metricPrefix) {
				g.Found = true
			}
		}
	}
	for k, v := range attempts {
		g.Attempts = append(g.Attempts, AttemptCount{Upstream: k[0], Outcome: k[1], Count: v})
	}
	sort.Slice(g.Attempts, func(i, j int) bool {
		a, b := g.Attempts[i], g.Attempts[j]
		if a.Upstream != b.Upstream {
			return a.Upstream < b.Upstream
		}
		return a.Outcome < b.Outcome
	})
	attempted := g.RequestsTotal
	for _, o := range []string{"circuit_open", "no_upstream", "refused", "invalid_request"} {
		attempted -= g.Requests[o]
	}
	g.Failovers = max(g.AttemptsTotal-attempted, 0)
	for le, c := range byLE {
		buckets = append(buckets, bucket{le, c})
	}
	g.TTFTP50 = nanToZero(bucketQuantile(0.5, buckets) * 1000)
	g.TTFTP99 = nanToZero(bucketQuantile(0.99, buckets) * 1000)
	return g
}

// hedgeDelayMS returns the highest hedge delay gauge of a scrape (not of a
// delta: a gauge's difference means nothing), in milliseconds, 0 if none.
func hedgeDelayMS(s Scrape) float64 {
	v := 0.0
	for _, x := range s {
		if x.Name == metricDelay {
			v = max(v, x.Value*1000)
		}
	}
	return v
}

type bucket struct {
	le    float64 // upper bound
	count float64 // cumulative
}

// bucketQuantile estimates a quantile from cumulative histogram buckets by
// linear interpolation within the bucket, as Prometheus'
// histogram_quantile does. It returns NaN without observations.
func bucketQuantile(q float64, buckets []bucket) float64 {
	sort.Slice(buckets, func(i, j int) bool { return buckets[i].le < buckets[j].le })
	if len(buckets) == 0 || !math.IsInf(buckets[len(buckets)-1].le, 1) {
		return math.NaN()
	}
	total := buckets[len(buckets)-1].count
	if total <= 0 {
		return math.NaN()
	}
	rank := q * total
	i := sort.Search(len(buckets), func(i int) bool { return buckets[i].count >= rank })
	if i == len(buckets)-1 {
		if len(buckets) < 2 {
			return math.NaN()
		}
		return buckets[len(buckets)-2].le // in the +Inf bucket: the highest finite bound
	}
	lower, prev := 0.0, 0.0
	if i > 0 {
		lower, prev = buckets[i-1].le, buckets[i-1].count
	}
	inBucket := buckets[i].count - prev
	if inBucket <= 0 {
		return buckets[i].le
	}
	return lower + (buckets[i].le-lower)*(rank-prev)/inBucket
}

func nanToZero(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return v
}
