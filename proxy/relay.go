package proxy

import (
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/sse"
)

// relay is step 7: every later event of a's stream as it arrives, flushed,
// with an idle timeout between events, inspected for usage, finish_reason,
// in-band errors and [DONE]. After commit nothing is retried; relay records
// how the stream ended and finish ends it (a failure becomes a terminal
// in-band error event, without [DONE]).
//
// Events that arrived together (complete in the scanner's buffer after the
// one that woke the relay) go out with one write and one flush; an event is
// never held back waiting for another.
func (x *exchange) relay(a *attempt) {
	w := &a.idle
	w.start(x.p.cfg.StreamIdleTimeout, a)
	defer w.stop()
	// Nothing reads the scanner after the relay: its buffer goes back to
	// the pool (finish drains a finished body straight from the response).
	defer a.sc.Release()
	var gaps GapRecorder
	var last time.Time // the first event's, then the last one's
	if g, ok := x.p.obs.(GapObserver); ok {
		gaps, last = g.StreamGaps(a.up.Addr, x.result.Info.Model), x.p.clock.Now()
	}
	for {
		ev, err := a.sc.Next()
		if err != nil {
			a.streamErr, a.goneAtEnd = err, x.clientGone()
			return
		}
		if gaps != nil {
			now := x.p.clock.Now()
			gaps.Observe(now.Sub(last).Seconds())
			last = now
		}
		// The idle timer measures the upstream only: it is off while the
		// gateway writes, so a slow client is not blamed on the upstream.
		w.busy()
		if !x.relayEvents(a, ev) {
			return
		}
		w.wait()
	}
}

// relayEvents relays ev and the events already complete behind it, with one
// write and one flush. It reports whether the stream goes on: false after
// [DONE], an upstream error event, or a client that went away.
func (x *exchange) relayEvents(a *attempt, ev sse.Event) bool {
	res := &x.result
	var (
		out     []byte  // what goes to the client
		batch   *[]byte // a pooled buffer, once a second event joins out
		events  int     // events in out
		content int     // generated events (chunks) in out
		done    bool    // out ends with the API's last event
		inband  *api.InbandError
	)
	for {
		relayed := true
		switch x.api.Inspect(&a.st, ev) {
		case api.Generated:
			content++
		case api.UsageOnly:
			if x.stripUsage {
				// Usage asked for on the client's behalf: read, not relayed.
				relayed = false
				break
			}
			content++
		case api.End:
			// The stream is complete: end the client's response now, and
			// let end() read the upstream's closing bytes in the
			// background so its connection goes back to the pool.
			done = true
			// An end without the API's normal end (a [DONE] before
			// response.completed, a message_stop without a stop_reason)
			// is not relayed: the terminal error event takes its place,
			// where the client reads it (OpenAI's SDKs stop at [DONE]).
			relayed = a.st.Finished
		case api.ErrorEvent:
			// The upstream's own error event is the terminal event.
			ie := a.st.Err
			inband = &ie
		}
		if relayed {
			switch {
			case events == 0:
				out = ev.Raw
			case batch == nil:
				batch = batchPool.Get().(*[]byte)
				out = append(append((*batch)[:0], out...), ev.Raw...)
			default:
				out = append(out, ev.Raw...)
			}
			events++
		}
		if done || inband != nil {
			break
		}
		next, ok := a.sc.NextBuffered()
		if !ok {
			break
		}
		ev = next
	}
	res.Usage = a.st.Usage
	sent := events == 0 || x.send(out, events)
	if batch != nil {
		putBatch(batch, out)
	}
	if !sent {
		a.clientLeft()
		return false
	}
	res.ContentEvents += content
	switch {
	case done:
		a.sawDone, a.drain = true, true
		if !a.st.Finished {
			a.streamErr = errNoNormalEnd
		}
		return false
	case inband != nil:
		a.postInband = inband
		return false
	}
	return true
}

// errNoNormalEnd is why a stream whose API's last event came without its
// normal end (a Messages message_stop without a stop_reason) is a cut.
var errNoNormalEnd = errors.New("the stream's last event came without its normal end")

// batchPool holds the buffers in which relayEvents joins events that
// arrived together; a stream holds one only while it writes.
var batchPool = sync.Pool{New: func() any {
	b := make([]byte, 0, 4<<10)
	return &b
}}

// maxPooledBatch bounds the buffers kept in batchPool: one that grew for a
// burst of large events is left to the garbage collector.
const maxPooledBatch = 64 << 10

func putBatch(b *[]byte, used []byte) {
	if cap(used) > maxPooledBatch {
		return
	}
	*b = used[:0]
	batchPool.Put(b)
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
		x.result.Events++
		x.p.obs.EventRelayed()
	}
	return true
}

// idleWatch is the stream idle timeout of a committed stream: it cancels
// the attempt with errIdleTimeout once the upstream has sent nothing for
// idle while the relay waited on it. Time spent writing to the client does
// not count.
//
// Its one timer is armed when the relay starts and not touched per event:
// an event costs a clock reading and two atomic stores, where stopping and
// re-arming a timer took the timer heap's lock twice. When the timer fires
// it looks at when the relay last started to wait and, if that was less
// than idle ago (or the relay is writing), re-arms itself for the rest.
type idleWatch struct {
	idle time.Duration
	a    *attempt // its exchange's clock and start time the watch
	t    clock.Timer
	// since is when the relay started waiting on the upstream, as the
	// time since the exchange's start; idleBusy while it handles events,
	// idleDone once the relay has ended.
	since atomic.Int64
}

const (
	idleBusy int64 = -1
	idleDone int64 = -2
)

// start arms the watch on a for a relay that is about to wait.
func (w *idleWatch) start(idle time.Duration, a *attempt) {
	w.idle, w.a = idle, a
	w.since.Store(int64(w.now()))
	// Armed once t is set, so that a callback always finds it.
	w.t = a.x.p.clock.AfterFunc(time.Hour, w.check)
	w.t.Reset(idle)
}

// now is the time since the exchange's start.
func (w *idleWatch) now() time.Duration { return w.a.x.since(w.a.x.start) }

// busy marks the relay as handling events (writing to the client).
func (w *idleWatch) busy() { w.since.Store(idleBusy) }

// wait marks the relay as waiting on the upstream from now.
func (w *idleWatch) wait() { w.since.Store(int64(w.now())) }

// stop ends the watch; a callback already running does nothing more.
func (w *idleWatch) stop() {
	w.since.Store(idleDone)
	w.t.Stop()
}

// check runs when the timer fires.
func (w *idleWatch) check() {
	switch s := w.since.Load(); s {
	case idleDone:
	case idleBusy:
		w.t.Reset(w.idle)
	default:
		left := w.idle - (w.now() - time.Duration(s))
		if left <= 0 {
			w.a.cancel(errIdleTimeout)
			return
		}
		w.t.Reset(left)
	}
}
