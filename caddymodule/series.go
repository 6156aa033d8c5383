package caddymodule

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// upstreamVec is a metric vector with an "upstream" label.
type upstreamVec interface {
	prometheus.Collector
	DeletePartialMatch(prometheus.Labels) int
}

// seriesLife decides when an upstream's series go: when the upstream has
// left the last config that had it (no entry in the registry) and its last
// attempt has ended (the departed entry's in-flight count is 0). It keeps
// the entries it has seen in the registry until both are true, so that a
// stream still running on an old config keeps its upstream's series.
type seriesLife struct {
	entries func() []*upstream.Entry

	mu    sync.Mutex
	known map[string]*upstream.Entry
}

// refresh learns the live entries and forgets departed ones with nothing
// in flight. It returns whether addr's series stay.
func (l *seriesLife) refresh() (keep func(addr string) bool) {
	live := l.entries()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.known == nil {
		l.known = map[string]*upstream.Entry{}
	}
	now := make(map[string]bool, len(live))
	for _, e := range live {
		now[e.Addr()] = true
		l.known[e.Addr()] = e
	}
	for addr, e := range l.known {
		if !now[addr] && e.Inflight() == 0 {
			delete(l.known, addr)
		}
	}
	known := make(map[string]bool, len(l.known))
	for addr := range l.known {
		known[addr] = true
	}
	return func(addr string) bool { return addr == "" || known[addr] }
}

// upstreamSeries is a per-upstream metric vector as registered: at each
// scrape, the series of upstreams that have left every config (and have
// no attempt in flight) are deleted before the rest are collected. A
// request that ends after that and counts again is deleted at the next
// scrape. The series with an empty upstream (requests that reached none)
// always stay.
type upstreamSeries struct {
	vec  upstreamVec
	life *seriesLife
}

func (s upstreamSeries) Describe(ch chan<- *prometheus.Desc) { s.vec.Describe(ch) }

func (s upstreamSeries) Collect(ch chan<- prometheus.Metric) {
	keep := s.life.refresh()
	got := make(chan prometheus.Metric)
	go func() {
		s.vec.Collect(got)
		close(got)
	}()
	var gone []string
	for m := range got {
		if addr := upstreamOf(m); !keep(addr) {
			gone = append(gone, addr)
			continue
		}
		ch <- m
	}
	for _, addr := range gone {
		s.vec.DeletePartialMatch(prometheus.Labels{"upstream": addr})
	}
}

// upstreamOf returns m's upstream label ("" without one).
func upstreamOf(m prometheus.Metric) string {
	var d dto.Metric
	if err := m.Write(&d); err != nil {
		return ""
	}
	for _, l := range d.GetLabel() {
		if l.GetName() == "upstream" {
			return l.GetValue()
		}
	}
	return ""
}

// perUpstream wraps the per-upstream vectors for registration.
func perUpstream(vecs ...upstreamVec) []prometheus.Collector {
	out := make([]prometheus.Collector, len(vecs))
	for i, v := range vecs {
		out[i] = upstreamSeries{vec: v, life: &shared.series}
	}
	return out
}
