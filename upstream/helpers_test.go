package upstream

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/hedge"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
	"github.com/llmproxy/caddy-llm-proxy/saturation"
)

// fakeObserver keeps what the pool reports: the breaker gauges as a
// metrics collector would hold them, and every event in order.
type fakeObserver struct {
	mu     sync.Mutex
	gauges map[string]breaker.State // by "addr|key"
	events []string
	short  map[string]int
	hedge  map[string]time.Duration // by "model|stream"
	// scrapes counts Scraped by upstream, scrapeErrs its failures;
	// signals holds the latest SignalUpdated by "addr|signal".
	scrapes, scrapeErrs map[string]int
	signals             map[string]signalReport
}

type signalReport struct {
	last        saturation.Value
	state, prev saturation.SignalState
}

func (o *fakeObserver) Scraped(upstream string, _ time.Duration, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.scrapes[upstream]++
	if err != nil {
		o.scrapeErrs[upstream]++
	}
}

func (o *fakeObserver) SignalUpdated(upstream string, sig saturation.Signal, last saturation.Value, state, prev saturation.SignalState) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.signals[upstream+"|"+sig.String()] = signalReport{last, state, prev}
	if state != prev {
		o.events = append(o.events, fmt.Sprintf("signal %s|%s %v→%v", upstream, sig, prev, state))
	}
}

func (o *fakeObserver) ScraperGone(upstream string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.events = append(o.events, "scraper gone "+upstream)
}

func newFakeObserver() *fakeObserver {
	return &fakeObserver{gauges: map[string]breaker.State{}, short: map[string]int{}, hedge: map[string]time.Duration{},
		scrapes: map[string]int{}, scrapeErrs: map[string]int{}, signals: map[string]signalReport{}}
}

func gaugeKey(upstream, key string) string { return upstream + "|" + key }

func (o *fakeObserver) BreakerCreated(upstream, key string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.gauges[gaugeKey(upstream, key)] = breaker.Closed
	o.events = append(o.events, "created "+gaugeKey(upstream, key))
}

func (o *fakeObserver) BreakerTransition(upstream, key, _ string, tr breaker.Transition) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.gauges[gaugeKey(upstream, key)] = tr.To
	o.events = append(o.events, fmt.Sprintf("transition %s %v→%v", gaugeKey(upstream, key), tr.From, tr.To))
}

func (o *fakeObserver) BreakerGone(upstream, key string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	delete(o.gauges, gaugeKey(upstream, key))
	o.events = append(o.events, "gone "+gaugeKey(upstream, key))
}

func (o *fakeObserver) ShortCircuited(upstream string) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.short[upstream]++
}

func (o *fakeObserver) HedgeDelay(model string, stream bool, d time.Duration) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.hedge[fmt.Sprintf("%s|%t", model, stream)] = d
}

// gauge returns the breaker gauge of upstream and key, and whether it exists.
func (o *fakeObserver) gauge(upstream, key string) (breaker.State, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	st, ok := o.gauges[gaugeKey(upstream, key)]
	return st, ok
}

func (o *fakeObserver) shortCircuited(upstream string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.short[upstream]
}

// eventsSince returns the events after the first n.
func (o *fakeObserver) eventsSince(n int) []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]string(nil), o.events[n:]...)
}

func (o *fakeObserver) count() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return len(o.events)
}

// countPrefix counts the events that start with prefix.
func (o *fakeObserver) countPrefix(prefix string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, e := range o.events {
		if strings.HasPrefix(e, prefix) {
			n++
		}
	}
	return n
}

// firstSelector always chooses the first candidate (Caddy's "first").
type firstSelector struct{}

func (firstSelector) Select([]Candidate, *http.Request, http.ResponseWriter) int { return 0 }

func targets(addrs ...string) []Target {
	out := make([]Target, len(addrs))
	for i, a := range addrs {
		out[i] = Target{Addr: a}
	}
	return out
}

// buildPool builds a pool (Provision) that the test releases at its end;
// it is not activated.
func buildPool(t *testing.T, reg *Registry, cfg Config) *Pool {
	t.Helper()
	p, err := reg.NewPool(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Release)
	return p
}

// startPool builds and activates a pool (Provision, then the config starts).
func startPool(t *testing.T, reg *Registry, cfg Config) *Pool {
	t.Helper()
	p := buildPool(t, reg, cfg)
	p.Activate()
	return p
}

// reload replaces old with a pool for cfg the way a config reload does:
// the new pool takes its references and starts before the old one stops
// and releases its own.
func reload(t *testing.T, old *Pool, cfg Config) *Pool {
	t.Helper()
	next := startPool(t, old.Registry(), cfg)
	old.Deactivate()
	old.Release()
	return next
}

func pickModel(p *Pool, model string, tried ...string) (proxy.Upstream, error) {
	return p.Pick(httptest.NewRecorder(), httptest.NewRequest("POST", "/", nil),
		proxy.PickRequest{Info: proxy.RequestInfo{Model: model}, Tried: tried})
}

func mustPick(t *testing.T, p *Pool, model string, tried ...string) proxy.Upstream {
	t.Helper()
	up, err := pickModel(p, model, tried...)
	if err != nil {
		t.Fatal(err)
	}
	return up
}

func finish(up proxy.Upstream, o proxy.AttemptOutcome) {
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: o})
}

func fail(up proxy.Upstream) {
	up.Done(&proxy.AttemptReport{Upstream: up.Addr, Outcome: proxy.AttemptHTTP5xx, Status: 503})
}

// breakerOf returns the live breaker of addr under model key ("" per
// upstream), failing the test when there is none.
func breakerOf(t *testing.T, reg *Registry, addr, key string) *breaker.Breaker {
	t.Helper()
	e, ok := reg.Entry(addr)
	if !ok {
		t.Fatalf("no entry for %s", addr)
	}
	// The newest started handler's breaker (of the newest config), else
	// the newest one's.
	var best *verdict
	for _, v := range e.verdictList() {
		if v.model != key || best != nil && best.c.active.Load() && !v.c.active.Load() {
			continue
		}
		if best == nil || v.c.active.Load() && !best.c.active.Load() || v.c.newerThan(best.c) {
			best = &v
		}
	}
	var b *breaker.Breaker
	if best != nil {
		b = best.b
	}
	if b == nil {
		t.Fatalf("no breaker %q for %s", key, addr)
	}
	return b
}

// httpTransport sends probes over plain HTTP (the prober leaves the scheme
// to the transport, as Caddy's does).
type httpTransport struct{}

func (httpTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	r.URL.Scheme = "http"
	return http.DefaultTransport.RoundTrip(r)
}

// probeServer is an upstream for active probes answering with status.
func probeServer(t *testing.T, status int) (addr string, probes func() int) {
	t.Helper()
	var mu sync.Mutex
	n := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		n++
		mu.Unlock()
		w.WriteHeader(status)
	}))
	t.Cleanup(srv.Close)
	return strings.TrimPrefix(srv.URL, "http://"), func() int {
		mu.Lock()
		defer mu.Unlock()
		return n
	}
}

func hedgeFixed(d time.Duration) hedge.DelayPolicy { return hedge.DelayPolicy{Fixed: d} }
