package upstream

import (
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// evidence is what the gateway knows of one upstream, whichever handler
// learnt it and whatever any handler's settings: the settings-free record
// beside the handlers' breakers (which judge the same outcomes by their
// own rules, Entry.hear). Every field is written lock-free on the request
// path, once per attempt.
type evidence struct {
	// recent is the outcomes of every attempt within RecentWindow.
	recent *breaker.Outcomes
	// downRun counts the Down outcomes (refused or reset connections,
	// first-byte timeouts) since the last attempt issued after the run
	// began that the upstream answered; downSince is when the run began
	// (unix ns, 0 with no run).
	downRun   atomic.Int64
	downSince atomic.Int64
	// lastLife is when an attempt last got an answer or a first token
	// (unix ns, 0 never); during a run of Down outcomes, only an attempt
	// issued since the run began counts.
	lastLife atomic.Int64
	// retryUntil is until when the upstream last asked to be left alone
	// (Retry-After; unix ns, 0 never).
	retryUntil atomic.Int64
}

// record adds one attempt's outcome: o, for an attempt issued at issued,
// at now. A sign of life is a new attempt that got an answer: an older
// stream that ends well says nothing of the connections refused since.
func (ev *evidence) record(o breaker.Outcome, issued, now time.Time) {
	ev.recent.Record(o)
	switch o {
	case breaker.Down:
		if ev.downRun.Add(1) == 1 {
			ev.downSince.Store(now.UnixNano())
		}
	case breaker.Success, breaker.Failure:
		if since := ev.downSince.Load(); since == 0 || issued.UnixNano() >= since {
			ev.lastLife.Store(now.UnixNano())
			ev.downRun.Store(0)
			ev.downSince.Store(0)
		}
	}
}

// UpstreamEvidence is an upstream's shared evidence as the admin API shows
// it beside each handler's verdict.
type UpstreamEvidence struct {
	// Recent is the outcomes of every handler's attempts within
	// RecentWindow (10 s).
	Recent breaker.OutcomeCounts `json:"recent"`
	// DownRun is the current run of refused or reset connections and
	// first-byte timeouts with no answer to a newer attempt between them;
	// DownSince when it began.
	DownRun   int64     `json:"down_run"`
	DownSince time.Time `json:"down_since,omitzero"`
	// LastSignOfLife is when an attempt last got an answer or a first
	// token (during a run of refused connections, one issued since it
	// began).
	LastSignOfLife time.Time `json:"last_sign_of_life,omitzero"`
	// RetryAfterUntil is until when the upstream last asked, with
	// Retry-After, to be left alone.
	RetryAfterUntil time.Time `json:"retry_after_until,omitzero"`
}

// Evidence returns the upstream's shared evidence.
func (e *Entry) Evidence() UpstreamEvidence {
	ev := &e.ev
	out := UpstreamEvidence{Recent: ev.recent.Counts(), DownRun: ev.downRun.Load()}
	at := func(ns int64) time.Time {
		if ns == 0 {
			return time.Time{}
		}
		return time.Unix(0, ns).UTC()
	}
	out.DownSince, out.LastSignOfLife, out.RetryAfterUntil = at(ev.downSince.Load()), at(ev.lastLife.Load()), at(ev.retryUntil.Load())
	return out
}
