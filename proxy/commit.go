package proxy

import (
	"net/http"
	"strconv"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// releaseBody lets go of the request body once a is committed: nothing can
// send it again (no retry, hedge or fallback after commit), so a stream
// that lasts minutes does not hold a prompt of any size, and its charge
// goes back to the body budget now. The transport has sent it (a's
// response is here; its bodyReader lets go at its end) and calls a's
// GetBody no more; a cancelled loser holds its own reference until it ends.
// With losers still running it leaves the client's request as it is: a
// hedged loser may yet build its own from it (request).
func (x *exchange) releaseBody(a *attempt, losers int) {
	x.body, x.client, a.body = nil, nil, nil
	if b, ok := x.r.Body.(*Body); ok {
		b.drop()
		x.held = nil
		if losers == 0 {
			// Nothing reads the request body after commit (the handler is
			// the last; net/http drains its own), and the holder is
			// garbage too.
			x.r.Body = http.NoBody
		}
	}
	x.releaseFallbackBodies()
}

// releaseFallbackBodies gives back the body budget's charge for the
// fallbacks' rewritten bodies, once.
func (x *exchange) releaseFallbackBodies() {
	if x.fbCharged > 0 {
		x.p.cfg.BodyBudget.release(x.fbCharged)
		x.fbCharged = 0
	}
}

// commit is step 6: a, the first attempt to reach its commit point, becomes
// the request's answer. Every other attempt is cancelled at once through its
// own context (neutral for its breaker), the hedge statistics learn, and the
// status, headers and head (the first event, or the whole body) go to the
// client, flushed. It reports whether there is a stream left to relay
// (none once the head carried the API's end).
func (x *exchange) commit(a *attempt) bool {
	// Held from here, so that finish ends a even if an observer panics.
	x.won = a
	rc := x.rc
	rc.cancelAll(a)
	losers := rc.inflight
	rc.abandon()
	x.releaseBody(a, losers)
	if rc.hedges > 0 {
		if a.hedge {
			x.p.obs.Hedge(HedgeWon)
		} else if losers > 0 {
			x.p.obs.Hedge(HedgeLost)
		}
	}
	if h := x.rung.pool.Hedging; h != nil {
		h.Observe(x.result.Info, a.ttft)
	}

	a.committed = true
	if a.up.Committed != nil {
		a.up.Committed(a.ttft)
	}
	res := &x.result
	res.Upstream = a.up.Addr
	res.Saturation = a.up.Saturation
	res.TTFT = x.since(x.start)
	res.AttemptTTFT = a.ttft
	res.Committed = true
	res.Status = a.status
	res.Usage = a.st.Usage

	h := x.w.Header()
	copyResponseHeader(h, a.resp.Header)
	// Nothing reads the outbound request or the upstream's response
	// beyond its status and body after this: a held stream should not
	// keep them (≈ 2 KB a stream). A hedged loser still running may yet
	// build its request with the outbound header.
	a.resp = nil
	if losers == 0 {
		x.outHeader = nil
	}
	if x.hdr != nil {
		x.hdr.base = nil
	}
	x.setAdmissionHeader(h)
	if !a.isSSE {
		res.ResponseBytes = len(a.head)
		h.Set("Content-Length", strconv.Itoa(len(a.head)))
		x.headerDown(a.status, h)
		x.w.WriteHeader(a.status)
		if _, err := x.w.Write(a.head); err != nil {
			a.writeFailed, a.writeErr = true, err
		}
		return false
	}
	res.Streamed = true
	h.Del("Content-Length")
	streamHeaders := []string{"no-cache", "no"} // one allocation for both
	h["Cache-Control"] = streamHeaders[0:1:1]
	h["X-Accel-Buffering"] = streamHeaders[1:2:2]
	x.headerDown(a.status, h)
	x.w.WriteHeader(a.status)
	x.out = *http.NewResponseController(x.w)
	sent := x.send(a.head, a.headEvents)
	// The head is the client's now; the stopped first-byte timer is
	// nothing's: a held stream keeps neither.
	a.head, a.fbTimer = nil, clock.Stopped
	if !sent {
		a.clientLeft()
		return false
	}
	res.ContentEvents += a.headContent
	if a.sawDone {
		// The head ended with the API's end: finish drains the rest.
		a.sc.Release()
		return false
	}
	return true
}
