package proxy

import (
	"context"
	"errors"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// attempt is step 5: it runs attempts until one reaches its commit point
// and returns it, or returns nil with x.failure saying why none did.
// Attempts have their own contexts. With hedging they run in their own
// goroutines and report on a channel, so the loop can wait at once on
// them, on the hedge timer and on the client; without, one runs at a
// time, on the request's goroutine (startAttempt), and its result is
// ready when it returns. A retryable failure asks the retry budget, backs off
// and picks again; when no first event has arrived after the hedge delay, a
// backup starts.
//
// Order of the gates (DESIGN §3): the breaker (inside the Balancer) first,
// then the retry budget, then hedging.
func (x *exchange) attempt() *attempt {
	pool := x.rung.pool
	x.rungHeader()
	rc := &race{x: x, pool: pool}
	rc.tried, rc.running = rc.firstTried[:0:1], rc.firstRunning[:0:1]
	if x.rc != nil {
		rc.counted = x.rc.counted // the ladder's earlier pools
	}
	x.rc = rc
	// A request earns retry and hedge capacity once per budget and cap: a
	// request the ladder brings back to the primary (backToPrimary), or
	// sends to a fallback pool that shares the primary's budget (the same
	// upstreams), is not a new request there.
	if r := pool.Retries; r != nil && !rc.counted.has(r) {
		rc.counted = append(rc.counted, r)
		r.Request()
	}
	if h := pool.Hedging; h != nil {
		if !rc.counted.has(h) {
			rc.counted = append(rc.counted, h)
			h.Request()
		}
		rc.hedgeDelay, rc.hedging = h.Delay(x.result.Info)
	}
	if rc.hedging {
		// Hedged attempts run in goroutines of their own and report here.
		rc.results = make(chan *attempt, x.p.cfg.MaxAttempts)
		// Armed by each primary when it starts (launch), not here.
		rc.hedgeTimer = x.p.clock.NewTimer(time.Hour)
		rc.hedgeTimer.Stop()
		defer rc.hedgeTimer.Stop()
	}
	up, err := rc.pick(false)
	if err != nil {
		x.failure = &failure{pickErr: err}
		return nil
	}
	rc.launch(up, false)
	for {
		var hedgeC <-chan time.Time
		if rc.hedgeArmed {
			hedgeC = rc.hedgeTimer.C()
		}
		if rc.inflight > 0 && !rc.hedging && x.ctx.Err() != nil {
			// An inline attempt ended with the request: the client is
			// gone (or stream_timeout passed), whatever the attempt saw.
			rc.abandon()
			x.failure = &failure{last: rc.last, ctxErr: context.Cause(x.ctx)}
			return nil
		}
		var a *attempt
		if rc.ready != nil {
			a, rc.ready = rc.ready, nil // an inline attempt's result
		} else {
			select {
			case a = <-rc.results:
			case <-hedgeC:
				rc.hedgeArmed = false
				if rc.hedge() && rc.hedges < pool.Hedging.MaxHedges() {
					rc.armHedge()
				}
				continue
			case <-x.ctx.Done():
				rc.abandon()
				x.failure = &failure{last: rc.last, ctxErr: context.Cause(x.ctx)}
				return nil
			}
		}
		rc.inflight--
		if a.ok {
			return a
		}
		a.end()
		rc.last = a
		if rc.inflight > 0 {
			if a.outcome.Retryable() || a.outcome == AttemptCanceled {
				continue // the other attempt of a hedged pair may still commit
			}
			// A 4xx: the request is at fault, and the other attempt
			// will hear the same. Answer now.
			rc.cancelAll(nil)
			rc.abandon()
			x.failure = &failure{last: a}
			return nil
		}
		// No primary runs any more: its hedge delay goes with it.
		rc.disarmHedge()
		if f := rc.retry(); f != nil {
			x.failure = f
			return nil
		}
	}
}

// race is the state of one request's attempts on one pool.
type race struct {
	x    *exchange
	pool *Pool
	// attempts counts the attempts started on pool, hedges included,
	// against max_attempts.
	attempts int
	// results is where hedged attempts report (nil without hedging);
	// ready holds an inline attempt's result until the loop takes it.
	results  chan *attempt
	ready    *attempt
	tried    []string
	inflight int
	running  []*attempt // every attempt launched, for cancelling losers
	last     *attempt
	retries  int
	hedges   int
	hedging  bool
	// hedgeTimer runs the hedge delay of the current primary: armed when
	// a primary starts, stopped while none runs (a backoff).
	hedgeTimer clock.Timer
	hedgeDelay time.Duration
	hedgeArmed bool
	// primaryClosed is whether the latest non-hedge attempt's upstream had
	// a closed breaker; a sick primary is never hedged.
	primaryClosed bool
	// counted lists the retry budgets and hedge caps that have counted
	// this request (Request), carried from race to race of one exchange.
	counted counted
	// firstTried and firstRunning hold the first attempt's entries of
	// tried and running: most requests make one attempt, and then neither
	// list allocates.
	firstTried   [1]string
	firstRunning [1]*attempt
}

// counted is a short list of the Retries and Hedging values a request was
// counted by, compared by identity (implementations are pointers, as
// upstream's are; a value that is not comparable is never deduplicated).
type counted []any

func (c counted) has(v any) bool {
	for _, o := range c {
		if sameValue(o, v) {
			return true
		}
	}
	return false
}

// sameValue is o == v, false where == would panic (non-comparable values).
func sameValue(o, v any) (same bool) {
	defer func() {
		if recover() != nil {
			same = false
		}
	}()
	return o == v
}

// launch starts an attempt on up. A primary gets its own hedge delay,
// counted from its start.
func (rc *race) launch(up Upstream, hedge bool) {
	x := rc.x
	rc.tried = append(rc.tried, up.Addr)
	rc.attempts++
	x.result.Attempts++
	x.result.Upstream = up.Addr
	x.result.Saturation = up.Saturation
	if !hedge {
		rc.primaryClosed = up.Closed
		if rc.hedging && rc.hedges < rc.pool.Hedging.MaxHedges() {
			rc.armHedge()
		}
	}
	// Without hedging no attempt runs beside another: it runs inline,
	// and its result is ready when startAttempt returns.
	a := x.startAttempt(up, rc.results)
	if rc.results == nil {
		rc.ready = a
	}
	a.hedge = hedge
	rc.running = append(rc.running, a)
	rc.inflight++
}

func (rc *race) armHedge() {
	rc.hedgeTimer.Reset(rc.hedgeDelay)
	rc.hedgeArmed = true
}

func (rc *race) disarmHedge() {
	if rc.hedgeArmed {
		rc.hedgeTimer.Stop()
		rc.hedgeArmed = false
	}
}

// retry decides, after every attempt has failed, whether another one runs:
// only for a retryable failure, within max_attempts, when the retry budget
// grants it, after a full-jitter backoff. It starts the attempt, or
// returns the failure to report at once.
//
// The budget is charged only once an upstream has been picked for the
// retry: a retry that finds no upstream (every breaker open, every slot
// taken) costs the budget nothing, so a failing pool that refuses requests
// does not drain the budget its recovery needs. It is charged before the
// backoff, so that a refused retry never sleeps: the client gets its error
// at once. The picked upstream is given back during the backoff and picked
// again after it; if none can be had then, the charge stays (an upstream
// was there when it was made, as with a request cancelled in its backoff).
// When every upstream asked for a short pause (Retry-After), the retry
// waits for the earliest first and is charged once it has an upstream.
func (rc *race) retry() *failure {
	x, retries, last := rc.x, rc.pool.Retries, rc.last
	stop := &failure{last: last}
	if !last.outcome.Retryable() || rc.attempts >= x.p.cfg.MaxAttempts || x.ctx.Err() != nil {
		return stop
	}
	if !retryAvailable(retries) {
		x.p.obs.RetryBudgetExhausted()
		return stop
	}
	n := rc.retries
	// With hedging on, a primary that fails before the hedge fires is
	// replaced at once: the failover is the backup.
	immediate := rc.hedging && rc.hedges == 0
	// Find out first whether any upstream can take the retry: a client
	// whose upstreams all asked for a long pause gets its 429/503 now, not
	// after a backoff.
	up, err := rc.pick(false)
	if err != nil {
		var ue *UnavailableError
		if !errors.As(err, &ue) || ue.RetryAfter <= 0 || retries == nil {
			return stop
		}
		// Wait for the earliest upstream only if that fits.
		d, ok := retries.Backoff(n, ue.RetryAfter, x.remaining())
		if !ok {
			return stop
		}
		if !x.sleep(d) {
			return &failure{last: last, ctxErr: context.Cause(x.ctx)}
		}
		if up, err = rc.pick(false); err != nil {
			return stop
		}
		if !rc.charge(up) {
			return stop
		}
	} else if retries != nil {
		// An upstream will be attempted: now the retry is charged.
		if !rc.charge(up) {
			return stop
		}
		// Going back to the upstream that asked for a pause (the only one,
		// or breakers off): honour its Retry-After if it fits, else stop.
		var retryAfter time.Duration
		if up.Addr == last.up.Addr {
			retryAfter = last.retryAfter
		}
		if retryAfter > 0 || !immediate {
			d, ok := retries.Backoff(n, retryAfter, x.remaining())
			if !ok && retryAfter > 0 {
				release(up)
				return stop
			}
			if ok && d > 0 {
				release(up)
				if !x.sleep(d) {
					return &failure{last: last, ctxErr: context.Cause(x.ctx)}
				}
				if up, err = rc.pick(false); err != nil {
					return stop
				}
			}
		}
	}
	x.p.obs.Retry(last.up.Addr, last.outcome)
	rc.retries++
	x.result.Retries = rc.retries
	rc.launch(up, false)
	return nil
}

// charge charges the retry budget for a retry on up, the upstream picked
// for it; when the budget refuses it gives up back and reports false.
func (rc *race) charge(up Upstream) bool {
	if rc.pool.Retries == nil || rc.pool.Retries.TryRetry() {
		return true
	}
	release(up)
	rc.x.p.obs.RetryBudgetExhausted()
	return false
}

// RetryPeeker is implemented by a Retries that can tell, without charging
// anything, whether a retry would be granted now (upstream's retry gate
// does). retry asks it before backing off, so that a spent budget answers
// the client at once instead of after a backoff; the charge itself still
// happens only when the retry starts.
type RetryPeeker interface {
	RetryAvailable() bool
}

// retryAvailable reports whether r may grant a retry now (true when r is
// nil, retries at once within max_attempts, or cannot say).
func retryAvailable(r Retries) bool {
	if pk, ok := r.(RetryPeeker); ok {
		return pk.RetryAvailable()
	}
	return true
}

// hedge runs when the hedge delay passes without a first event: it starts
// a backup on another upstream when the primary's breaker is closed, the
// hedge-rate cap and the retry budget allow, and attempts remain. It
// reports whether a backup started.
//
// The backup's upstream is picked first: the cap and the budget are
// charged only when there is one to attempt.
func (rc *race) hedge() bool {
	x, h, retries := rc.x, rc.pool.Hedging, rc.pool.Retries
	if rc.inflight == 0 || rc.hedges >= h.MaxHedges() || rc.attempts >= x.p.cfg.MaxAttempts {
		return false
	}
	if !rc.primaryClosed || !retryAvailable(retries) {
		x.p.obs.Hedge(HedgeSuppressed)
		return false
	}
	up, err := rc.pick(true)
	if err != nil {
		x.p.obs.Hedge(HedgeSuppressed)
		return false
	}
	// The hedge-rate cap is asked before the budget: when the budget then
	// refuses (a failing pool, where hedging is unwanted anyway) a cap slot
	// is spent, which only makes hedging more conservative; the other order
	// would spend retry budget on hedges the cap refuses.
	if !h.TryHedge() || (retries != nil && !retries.TryRetry()) {
		release(up)
		x.p.obs.Hedge(HedgeSuppressed)
		return false
	}
	rc.launch(up, true)
	rc.hedges++
	x.result.Hedged = true
	x.p.obs.Hedge(HedgeFired)
	return true
}

// cancelAll cancels every attempt launched except keep, through its own
// context (neutral for its breaker).
func (rc *race) cancelAll(keep *attempt) {
	for _, o := range rc.running {
		if o != keep {
			o.cancel(errLostRace)
		}
	}
}

// abandon ends the attempts still running as they report, without waiting
// for them; each is cancelled (it may have reached its commit point since).
func (rc *race) abandon() {
	n := rc.inflight
	rc.inflight = 0
	if a := rc.ready; a != nil {
		rc.ready = nil
		n--
		a.cancel(errLostRace)
		a.end()
	}
	if n == 0 {
		return
	}
	// The model as these attempts asked for it: the request's goroutine
	// may go on to a fallback, which rewrites it.
	results, model := rc.results, rc.x.result.Info.Model
	go func() {
		for range n {
			a := <-results
			a.cancel(errLostRace)
			a.endAs(model)
		}
	}()
}

// remaining is the time left before stream_timeout, 0 without one.
func (x *exchange) remaining() time.Duration {
	if x.p.cfg.StreamTimeout <= 0 {
		return 0
	}
	return max(x.p.cfg.StreamTimeout-x.since(x.start), time.Nanosecond)
}

// sleep waits d, or until the request ends; it reports whether d passed.
func (x *exchange) sleep(d time.Duration) bool {
	if d <= 0 {
		return x.ctx.Err() == nil
	}
	t := x.p.clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C():
		return true
	case <-x.ctx.Done():
		return false
	}
}

// failure is why a request got no committed attempt.
type failure struct {
	// last is the last failed attempt, if any ran.
	last *attempt
	// pickErr is the Balancer's error when no attempt could start.
	pickErr error
	// ctxErr is the request context's cause when it ended the loop.
	ctxErr error
}
