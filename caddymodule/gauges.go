package caddymodule

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

// gateObserver is one gate's admission observer. A gate reports its own
// per-tier counts (queued, in flight); caddy_llm_proxy_queue_depth{tier}
// and caddy_llm_proxy_inflight{tier} are the sums of those counts over
// every gate of the process — every handler's pool and every fallback
// pool — so each gate adds the change of its count since its last report
// instead of setting the gauge to its own count. A gate's counts return
// to 0 as its requests end (also after its config is unloaded), so its
// share of the sums does too.
type gateObserver struct {
	admissionObserver
	// queued and inflight are the counts this gate reported last, by
	// tier. The gate reports with its lock held, so they need no lock.
	queued, inflight map[string]int
}

func newGateObserver() *gateObserver {
	return &gateObserver{queued: map[string]int{}, inflight: map[string]int{}}
}

// QueueDepth adds the change of the gate's queued count of tier.
func (o *gateObserver) QueueDepth(tier string, n int) {
	initMetrics()
	metrics.queueDepth.WithLabelValues(tier).Add(float64(n - o.queued[tier]))
	o.queued[tier] = n
}

// Inflight adds the change of the gate's in-flight count of tier.
func (o *gateObserver) Inflight(tier string, n int) {
	initMetrics()
	metrics.inflight.WithLabelValues(tier).Add(float64(n - o.inflight[tier]))
	o.inflight[tier] = n
}

// tenantBreakerCollector is caddy_llm_proxy_tenant_breaker_state: the
// tenant breakers that are not closed, by the tier each tenant has in the
// newest running config and by state (open, half-open), counted from the
// breakers themselves at each scrape. A count cannot go negative, and a
// tenant moved to another tier by a reload (or a breaker rebuilt while
// open) is counted once, under its tier now. Every tier of the config has
// its two series, at 0 when no breaker of it is in that state.
type tenantBreakerCollector struct {
	desc *prometheus.Desc
	// tenants returns the controller whose breakers are counted and the
	// tiers of its config (nil: no tenants, no series).
	tenants func() (*admission.Controller, []string)
}

// tenantBreakerStates are the states tenant_breaker_state counts.
var tenantBreakerStates = []breaker.State{breaker.Open, breaker.HalfOpen}

func (c tenantBreakerCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c tenantBreakerCollector) Collect(ch chan<- prometheus.Metric) {
	ctl, tiers := c.tenants()
	if ctl == nil {
		return
	}
	type key struct {
		tier  string
		state breaker.State
	}
	counts := map[key]int{}
	for _, tier := range tiers {
		for _, st := range tenantBreakerStates {
			counts[key{tier, st}] = 0
		}
	}
	for _, v := range ctl.Tenants() {
		if v.Breaker != nil && v.Breaker.State != breaker.Closed {
			counts[key{v.Tier, v.Breaker.State}]++
		}
	}
	for k, n := range counts {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), k.tier, k.state.String())
	}
}

// runningTenants is the controller and tier names of the newest running
// config with tenants.
func runningTenants() (*admission.Controller, []string) {
	c := shared.live.Newest()
	if c == nil || c.Tenants == nil {
		return nil, nil
	}
	var tiers []string
	for _, ti := range c.Tenants.Config.Tiers {
		tiers = append(tiers, ti.Name)
	}
	return c.Tenants.Controller, tiers
}

// breakerStateCollector is caddy_llm_proxy_breaker_state{pool,upstream,model}:
// the state of every breaker of every upstream of every pool of the
// running configs, read from the breakers at each scrape. A breaker shared
// by two pools (one upstream in both) has a series in each, so "every
// upstream of a pool is open" is min by (pool) >= 1; a breaker that is
// gone, or whose upstream left every running config, has no series. When
// handlers in front of the same upstreams have different breaker policies
// (so different breakers), each one's pool label is followed by
// "~<policy>" (BreakerView.Policy's fingerprint), so that each handler's
// breakers have their own series.
type breakerStateCollector struct{ desc *prometheus.Desc }

func (c breakerStateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c breakerStateCollector) Collect(ch chan<- prometheus.Metric) {
	type key struct{ pool, upstream, model string }
	seen := map[key]bool{}
	pools := runningPools()
	policies := map[string]map[string]bool{} // pool label → policies with breakers on
	for _, p := range pools {
		if pol := p.Policy(); pol != "" {
			l := poolLabel(p.Key())
			if policies[l] == nil {
				policies[l] = map[string]bool{}
			}
			policies[l][pol] = true
		}
	}
	for _, p := range pools {
		pool := poolLabel(p.Key())
		if len(policies[pool]) > 1 {
			pool += "~" + p.Policy()
		}
		for _, e := range p.Entries() {
			for model, b := range p.Breakers(e) {
				k := key{pool, e.Addr(), model}
				if seen[k] {
					continue
				}
				seen[k] = true
				ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(b.State()), k.pool, k.upstream, k.model)
			}
		}
	}
}

// runningPools returns the pools of every running config, newest config
// first.
func runningPools() []*upstream.Pool { return shared.live.Pools() }

// poolLabel is the pool label of a pool's key: its sorted dial addresses
// joined by commas ("fallback <name> " before a fallback's), with a
// dynamic source's configuration replaced by the first 12 hex digits of
// its sha256 ("dynamic:3f2a…"), so the label stays short and stable
// across reloads.
func poolLabel(key string) string {
	const dyn = "dynamic:"
	i := strings.Index(key, dyn)
	if i < 0 {
		return key
	}
	sum := sha256.Sum256([]byte(key[i+len(dyn):]))
	return key[:i] + dyn + hex.EncodeToString(sum[:6])
}
