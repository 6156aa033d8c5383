package proxy

import (
	"errors"
	"net/http"

	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// relay is step 7: every later event of a's stream as it arrives, flushed,
// with an idle timeout between events, inspected for usage, finish_reason,
// in-band errors and [DONE]. After commit nothing is retried; relay records
// how the stream ended and finish ends it (a failure becomes a terminal
// in-band error event, without [DONE]).
func (x *exchange) relay(a *attempt) {
	idle := x.p.cfg.StreamIdleTimeout
	idleTimer := x.p.clock.AfterFunc(idle, func() { a.cancel(errIdleTimeout) })
	defer idleTimer.Stop()
	res := x.res
	for {
		ev, err := a.sc.Next()
		if err != nil {
			a.streamErr, a.goneAtEnd = err, x.clientGone()
			return
		}
		// The idle timer measures the upstream only: it is off while the
		// gateway writes, so a slow client is not blamed on the upstream.
		idleTimer.Stop()
		kind := ev.Kind()
		var ci sse.ChunkInfo
		if kind == sse.KindData {
			ci = sse.InspectChunk(ev.Data)
			res.Usage = chunkUsage(ci, res.Usage)
			if ci.UsageOnly && x.stripUsage {
				// Usage asked for on the client's behalf: read, not relayed.
				idleTimer.Reset(idle)
				continue
			}
		}
		if !x.send(ev.Raw, 1) {
			a.clientLeft()
			return
		}
		idleTimer.Reset(idle)
		switch kind {
		case sse.KindData:
			res.ContentEvents++
			a.finished = a.finished || ci.FinishReason
		case sse.KindDone:
			// The stream is complete: end the client's response now, and
			// let end() read the upstream's closing chunk in the
			// background so its connection goes back to the pool.
			a.sawDone, a.drain = true, true
			return
		case sse.KindError:
			// The upstream's own error event is the terminal event.
			ie, _ := sse.ParseInbandError(ev.Data)
			a.postInband = &ie
			return
		}
	}
}

// clientLeft records a client that went away mid-response: neutral for the
// upstream, which is cancelled at once.
func (a *attempt) clientLeft() {
	a.writeFailed = true
	a.cancel(errLostRace)
}

// send writes p to the client and flushes it. events is how many SSE events
// p holds. It reports false when the client is gone.
func (x *exchange) send(p []byte, events int) bool {
	if _, err := x.w.Write(p); err != nil {
		return false
	}
	if err := x.out.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
		return false
	}
	for range events {
		x.res.Events++
		x.p.obs.EventRelayed()
	}
	return true
}
