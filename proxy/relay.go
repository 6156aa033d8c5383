package proxy

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// relay is steps 5 and 6: commit to a, then relay its stream event by event.
// After commit nothing is retried; a failure becomes a terminal in-band
// error event and the stream ends without [DONE].
func (x *exchange) relay(a *attempt) {
	committed := true
	defer func() { a.end(committed) }()
	// Until a path below says otherwise (a panic included), the attempt
	// ends neutral: only a finished response is a success.
	a.outcome = AttemptCanceled
	if a.up.Committed != nil {
		a.up.Committed(a.ttft)
	}
	res := x.res
	res.Upstream = a.up.Addr
	res.TTFT = time.Since(x.start)
	res.Status = a.resp.StatusCode

	h := x.w.Header()
	copyResponseHeader(h, a.resp.Header)
	if !a.isSSE {
		h.Set("Content-Length", strconv.Itoa(len(a.head)))
		x.w.WriteHeader(a.resp.StatusCode)
		if _, err := x.w.Write(a.head); err != nil {
			a.outcome, a.err = AttemptCanceled, err
			res.Outcome = OutcomeClientGone
			return
		}
		a.outcome = AttemptSuccess
		res.Outcome = OutcomeSuccess
		return
	}

	res.Streamed = true
	h.Del("Content-Length")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no")
	x.w.WriteHeader(a.resp.StatusCode)
	rc := http.NewResponseController(x.w)
	if !x.send(rc, a.head, a.headEvents) {
		x.endClientGone(a)
		return
	}

	idle := x.p.cfg.StreamIdleTimeout
	idleTimer := time.AfterFunc(idle, func() { a.cancel(errIdleTimeout) })
	defer idleTimer.Stop()

	finished := a.finished
	var err error
	for {
		var ev sse.Event
		ev, err = a.sc.Next()
		if err != nil {
			break
		}
		// The idle timer measures the upstream only: it is off while the
		// gateway writes, so a slow client is not blamed on the upstream.
		idleTimer.Stop()
		kind := ev.Kind()
		if !x.send(rc, ev.Raw, 1) {
			x.endClientGone(a)
			return
		}
		idleTimer.Reset(idle)
		switch kind {
		case sse.KindData:
			if !finished && sse.InspectChunk(ev.Data).FinishReason {
				finished = true
			}
		case sse.KindDone:
			// The stream is complete: end the client's response now, and
			// let end() read the upstream's closing chunk in the
			// background so its connection goes back to the pool.
			a.outcome = AttemptSuccess
			a.drain = true
			res.Outcome = OutcomeSuccess
			return
		case sse.KindError:
			// The upstream's own error event is the terminal event.
			ie, _ := sse.ParseInbandError(ev.Data)
			a.outcome, a.err = AttemptInbandError5xx, fmt.Errorf("upstream %s: error event after commit: %s", a.up.Addr, ie.Message)
			switch {
			case ie.Status == http.StatusTooManyRequests:
				a.outcome = AttemptInbandError429
			case ie.Status >= 400 && ie.Status < 500:
				a.outcome = AttemptInbandError4xx
			}
			res.Outcome = OutcomeInbandError
			return
		}
	}
	x.endStream(rc, a, finished, err)
}

// endStream classifies a stream whose reading stopped with err.
func (x *exchange) endStream(rc *http.ResponseController, a *attempt, finished bool, err error) {
	res := x.res
	if x.clientGone() {
		x.endClientGone(a)
		return
	}
	if finished {
		// finish_reason arrived: the answer is whole, whatever came after.
		a.outcome = AttemptSuccess
		res.Outcome = OutcomeSuccess
		return
	}
	var msg, code string
	a.outcome = a.causeOr(AttemptTruncated)
	switch a.outcome {
	case AttemptIdleTimeout:
		res.Outcome, code = OutcomeIdleTimeout, "stream_idle_timeout"
		msg = fmt.Sprintf("upstream sent no event for %v", x.p.cfg.StreamIdleTimeout)
	case AttemptStreamTimeout:
		res.Outcome, code = OutcomeStreamTimeout, "stream_timeout"
		msg = fmt.Sprintf("response exceeded %v", x.p.cfg.StreamTimeout)
	default:
		a.outcome = AttemptTruncated
		res.Outcome, code = OutcomeTruncated, "upstream_stream_truncated"
		msg = "upstream stream ended before completion"
		if errors.Is(err, sse.ErrEventTooLarge) {
			msg = fmt.Sprintf("upstream sent an SSE event larger than the gateway's %d-byte limit", x.p.cfg.MaxEventSize)
		}
	}
	a.err = fmt.Errorf("upstream %s: %s: %w", a.up.Addr, msg, a.errWithCause(err))
	ev := sse.AppendErrorEvent(nil, msg, TypeServer, code)
	x.send(rc, ev, 0)
}

// endClientGone records a client that went away mid-stream: neutral for the
// upstream, which is cancelled at once.
func (x *exchange) endClientGone(a *attempt) {
	a.cancel(errLostRace)
	a.outcome, a.err = AttemptCanceled, nil
	x.res.Outcome = OutcomeClientGone
}

// send writes p to the client and flushes it. events is how many SSE events
// p holds. It reports false when the client is gone.
func (x *exchange) send(rc *http.ResponseController, p []byte, events int) bool {
	if _, err := x.w.Write(p); err != nil {
		return false
	}
	if err := rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return false
	}
	for range events {
		x.res.Events++
		x.p.obs.EventRelayed()
	}
	return true
}
