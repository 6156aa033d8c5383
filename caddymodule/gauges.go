package caddymodule

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
