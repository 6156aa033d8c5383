package fleet

import (
	"crypto/rand"
	"encoding/hex"
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// Breakers is the fleet's breaker store on Redis: a breaker.Fleet, so the
// breakers of every gateway built WithStore of it trip once for the whole
// fleet, on the fleet's failures (DESIGN §9). It is the Redis
// twin of breakertest.SharedMemory (breaker/breakertest), with the same semantics, and follows the
// contract of breaker.Fleet:
//
//   - Failure and Success never wait: they queue a report (a bounded queue;
//     a report that finds it full is dropped and counted through
//     BreakersOptions.OnDrop), and one background worker sends each as one
//     script. A failure adds to the key's fleet consecutive count, its set
//     of reporters and its rolling window of failures; when the reporting
//     breaker's rules (ConsecutiveFailures; Failures within FailuresWindow)
//     fire on those counts with at least Config.MinReporters distinct
//     instances, the script opens the key for the breaker's OpenFor and
//     publishes it, and every instance's breakers of the key adopt it. A
//     success ends the fleet's run (only while the key's flag says the run
//     may be non-zero).
//   - The ratio rules (FailureRatio, SlowRatio over RatioWindow) are
//     decided on the fleet's sums: every Refresh, and after a failure
//     report (at most every Refresh/5), each instance writes the sums of
//     its breaker's ratio window for the key into a hash in Redis (one
//     field per instance, dropped when older than 3 × Refresh), and the
//     script opens the key when the sums over every instance fire a rule
//     with at least MinRequests requests, from Config.MinReporters
//     instances. So ten gateways that see 5 requests each, all failing,
//     open the key although none has MinRequests of its own. Nothing of
//     it is on the request path: the sums are read from the breakers'
//     lock-free windows by the worker.
//   - Recovery and re-opens are counted fleet-wide: a half-open probe
//     success of a breaker open on a fleet verdict (ProbeSuccess) adds to
//     the key's recovered counter in Redis, and the success that brings it
//     to the breaker's RecoverySuccesses closes the key for the fleet (the
//     successes of every instance's lease holders add up; a success from
//     an expired lease is not counted, and a counted one extends its lease
//     by a lease time, so that its holder sends the next recovery probe
//     as well). A failed probe (Reopen) writes the
//     fleet's re-open count into the open record; every instance keeps it
//     in memory (Reopens), so whichever instance probes next grows the
//     cooldown from it; a close sets it back to zero.
//   - PutOpen and ClearOpen (operators, Retry-After, the probes of fleet
//     verdicts, observed trips) change this instance's copy at once and are
//     written and published in the background; the other instances' breakers
//     adopt them. A write that fails is kept (the newest per key) and tried
//     again every Refresh, and after local mode; such a replay is dropped
//     if the fleet's record was set after the write was made.
//   - One gateway probes (DESIGN §9): the breakers here
//     adopt a fleet open until its end plus the key's probe lease time
//     (LeaseTTL), so none half-opens on its own at the end; then one
//     instance takes the key's probe lease and its breakers half-open, the
//     others keep refusing until the result is published (lease.go).
//   - OpenUntil answers from memory: the open set as the channel's messages
//     and a bulk read of the joined keys every Refresh leave it. The bulk
//     read also opens this instance's closed breakers of a key the fleet
//     says is open (a gateway started, or back from local mode, while it
//     is), sets the keys' flags from the fleet's counts, and writes again
//     this instance's opens that the fleet has lost (a Redis restarted
//     empty).
//
// In local mode (Client.Degraded) nothing is queued and the queue is
// dropped: breakers keep working on their own rules. When Redis returns,
// the failed writes are replayed and the open set is read again, within a
// Refresh of the switch.
//
// Times: breakers sharing a Breakers must read the system clock (the
// default): their times and the store's are compared with each other.
// Times in Redis are Redis's own; a record's remaining time is converted
// to this instance's clock when it is read.
//
// Build it with NewBreakers; Close it before its Client. Safe for
// concurrent use.
type Breakers struct {
	c       *Client
	id      string
	channel string
	onDrop  func(op string)
	onLease func(result string)
	lease   time.Duration // BreakersOptions.LeaseTTL, defaults applied
	nonce   string
	seq     atomic.Uint64

	queue chan report
	// wake asks the worker to write the pending writes; refreshNow to read
	// the open set now (a key joined, a subscription (re)established);
	// leaseNow to try the probe leases (a fleet open ended).
	wake, refreshNow, leaseNow chan struct{}
	// offset is Redis's clock minus this instance's, in ms, from the last
	// reply (for replays, whose times are this instance's).
	offset atomic.Int64

	mu     sync.Mutex
	keys   map[string]*keyState
	writes map[string]*write // pending PutOpen/ClearOpen, the newest per key
	outbox []push
	closed bool
	// pushing is held by the goroutine delivering the outbox (TryLock only).
	pushing sync.Mutex

	subMu  sync.Mutex
	sub    interface{ Close() error } // the current subscription
	stop   chan struct{}
	wg     sync.WaitGroup
	unhook func()
}

// BreakersOptions tune a Breakers. The zero value is the default.
type BreakersOptions struct {
	// QueueSize bounds the reports waiting for the worker. Default 1024.
	QueueSize int
	// OnDrop is called (quickly, from the reporting call) when a report is
	// dropped because the queue is full: op is "breaker_failure" or
	// "breaker_reset". Default: nothing.
	OnDrop func(op string)
	// LeaseTTL is the time-to-live of a key's probe lease: the instance
	// that takes it is the only one whose breakers of the key half-open
	// (for the user probe or the active prober) until it publishes the
	// result or the lease expires, so one instance at a time probes an
	// open upstream, and a lease holder that dies frees the key within
	// it. Each probe success counted toward recovery extends the lease by
	// LeaseTTL, so that the holder's next recovery probe, an active probe
	// interval later, is still its own. It must be at most the probe
	// interval so that every interval has a prober. Each key's lease is at
	// most 0.8 × the shortest OpenFor of its breakers here, and at least
	// 2 × Refresh (the losers' refusals are renewed every Refresh).
	// Default DefaultProbeLeaseTTL: 0.8 × the default 5s probe interval.
	LeaseTTL time.Duration
	// OnLease is called (quickly, from the worker) with each probe lease
	// outcome of this instance: "won" (its breakers of the key probe),
	// "lost" (another instance holds it; once per lease), "expired" (a
	// probe result written after the lease ran out, dropped). Default:
	// nothing.
	OnLease func(result string)
}

// DefaultProbeLeaseTTL is BreakersOptions.LeaseTTL's default.
const DefaultProbeLeaseTTL = 4 * time.Second

// Fixed times of the shared breakers' keys.
const (
	// breakerIdleTTL is how long a key's consecutive count and reporters
	// live after its last failure: a run with no failure for this long is
	// forgotten.
	breakerIdleTTL = 10 * time.Minute
	// breakerGrace is how long an open record outlives its end, and a
	// tombstone its close: a recovery after the end still closes the
	// breakers that adopted it, and a replay older than a close is refused.
	breakerGrace = 10 * time.Minute
)

// keyState is this instance's view of one breaker key.
type keyState struct {
	// dirty is the flag Join hands out: the fleet's consecutive count may
	// be non-zero.
	dirty   atomic.Bool
	members []*breaker.Breaker

	open   bool
	until  time.Time // this instance's clock; zero: until closed
	reason string
	by     string // the instance that opened it
	at     int64  // when the record was set, ms on Redis's clock; 0: not yet written
	// reopens is the fleet's re-open count of the key since it last
	// closed (the open record's "n").
	reopens int
	// changed is when this instance last changed the key (a write, a
	// message): a bulk read that started before says nothing new.
	changed time.Time

	// lease is the probe lease this instance took ("<id>:<gen>"), until a
	// write (the probe's result) carries it; "" none.
	lease string
	// lost is the last lease of another instance counted as lost here.
	lost string
	// expired is the last lease of this instance counted as expired.
	expired string
	// timer tries the lease at the end of the fleet's open time.
	timer *time.Timer

	// ratioSent is set while the last ratio window sums written for this
	// instance were non-zero; ratioAt is when they were written.
	ratioSent bool
	ratioAt   time.Time
}

func (k *keyState) openAt(now time.Time) bool {
	return k.open && (k.until.IsZero() || k.until.After(now))
}

// write is a PutOpen or ClearOpen waiting to reach Redis.
type write struct {
	open   bool
	until  time.Time // zero: until closed
	reason string
	made   time.Time
	replay bool // tried before: a record set after made wins
	// lease is the probe lease held when the write was made: the write is
	// the probe's result, applied only while the lease is still this one.
	lease string
	// reopens is the fleet's re-open count written with an open.
	reopens int
}

// report is a queued Failure, reset (Success) or ProbeSuccess.
type report struct {
	reset    bool
	success  bool // a probe success; recov is the breaker's RecoverySuccesses
	recov    int
	lease    string        // the probe lease held at a probe success
	leaseTTL time.Duration // the key's lease time, by which a counted success extends the lease
	key      string
	reason   string
	consec   int
	failures int
	window   time.Duration
	openFor  time.Duration
}

// push is one verdict for one breaker, delivered without any lock held:
// Adopt (open), AdoptClose, or ProbeNow (probe).
type push struct {
	b      *breaker.Breaker
	open   bool
	probe  bool
	until  time.Time
	reason string
}

// NewBreakers returns the breaker store of c's fleet and starts its
// background work (the worker, the subscription, the bulk refresh).
func NewBreakers(c *Client, opts BreakersOptions) *Breakers {
	if opts.QueueSize <= 0 {
		opts.QueueSize = 1024
	}
	if opts.LeaseTTL <= 0 {
		opts.LeaseTTL = DefaultProbeLeaseTTL
	}
	var nb [4]byte
	_, _ = rand.Read(nb[:])
	bs := &Breakers{
		c:          c,
		id:         c.InstanceID(),
		channel:    c.cfg.KeyPrefix + "breakers",
		onDrop:     opts.OnDrop,
		onLease:    opts.OnLease,
		lease:      opts.LeaseTTL,
		nonce:      hex.EncodeToString(nb[:]),
		queue:      make(chan report, opts.QueueSize),
		wake:       make(chan struct{}, 1),
		refreshNow: make(chan struct{}, 1),
		leaseNow:   make(chan struct{}, 1),
		keys:       make(map[string]*keyState),
		writes:     make(map[string]*write),
		stop:       make(chan struct{}),
	}
	bs.unhook = c.OnModeChange(bs.modeChanged)
	bs.wg.Add(2)
	go bs.work()
	go bs.subscribe()
	return bs
}

// Degraded reports whether the store is in local mode (its Client is).
func (bs *Breakers) Degraded() bool { return bs.c.Degraded() }

// InstanceID is the id under which this instance reports.
func (bs *Breakers) InstanceID() string { return bs.id }

// OpenState is what this instance knows of a key open in the fleet.
type OpenState struct {
	// Until is the end of the open time on this instance's clock; zero
	// until an operator closes it.
	Until time.Time
	// Reason is the fleet's reason.
	Reason string
	// By is the instance that opened it: whose failure crossed the fleet's
	// threshold, or that wrote the open (an operator's, a Retry-After).
	By string
}

// Opened returns what this instance knows of key's open record, for the
// admin API; false when the fleet does not say it is open.
func (bs *Breakers) Opened(key string) (OpenState, bool) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	k, ok := bs.keys[key]
	if !ok || !k.openAt(time.Now()) {
		return OpenState{}, false
	}
	return OpenState{Until: k.until, Reason: k.reason, By: k.by}, true
}

// keyLocked returns key's state, creating it.
func (bs *Breakers) keyLocked(key string) *keyState {
	k, ok := bs.keys[key]
	if !ok {
		k = new(keyState)
		bs.keys[key] = k
	}
	return k
}

// forgetLocked drops key's state when nothing needs it: no breaker joined,
// not open, no write pending.
func (bs *Breakers) forgetLocked(key string, k *keyState, now time.Time) {
	if len(k.members) > 0 || k.openAt(now) || bs.writes[key] != nil {
		return
	}
	k.dirty.Store(false) // a breaker that left may still read it
	delete(bs.keys, key)
}

// Join implements breaker.Fleet. The key's flag starts set when the key is
// new here (the fleet's count is not known yet; the first success tells
// the fleet, and the next bulk refresh reads the count), and a read of the
// open set is started, so that a breaker created while the key is open in
// the fleet adopts it at once.
func (bs *Breakers) Join(key string, b *breaker.Breaker) *atomic.Bool {
	bs.mu.Lock()
	k, known := bs.keys[key]
	if !known {
		k = bs.keyLocked(key)
		k.dirty.Store(!bs.closed)
	}
	found := false
	for _, m := range k.members {
		found = found || m == b
	}
	if !found && !bs.closed {
		k.members = append(k.members, b)
	}
	bs.mu.Unlock()
	if !known {
		poke(bs.refreshNow)
	}
	return &k.dirty
}

// Leave implements breaker.Fleet.
func (bs *Breakers) Leave(key string, b *breaker.Breaker) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	k, ok := bs.keys[key]
	if !ok {
		return
	}
	for i, m := range k.members {
		if m == b {
			k.members = append(k.members[:i:i], k.members[i+1:]...)
			break
		}
	}
	bs.forgetLocked(key, k, time.Now())
}

// Failure implements breaker.Fleet: it sets the key's flag and queues the
// report, unless the key is open in the fleet already (it is not counted;
// the breaker adopts the open entry through OpenUntil) or the store is in
// local mode.
func (bs *Breakers) Failure(key string, s breaker.Settings, _ time.Time, reason string) {
	if bs.c.Degraded() {
		return
	}
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return
	}
	if k, ok := bs.keys[key]; ok {
		if k.openAt(time.Now()) {
			bs.mu.Unlock()
			return
		}
		k.dirty.Store(true)
	}
	bs.mu.Unlock()
	bs.enqueue(report{key: key, reason: reason, consec: s.ConsecutiveFailures, failures: s.Failures,
		window: s.FailuresWindow, openFor: s.OpenFor}, "breaker_failure")
}

// Success implements breaker.Fleet: it clears the key's flag and, if it
// was set, queues the reset of the fleet's run.
func (bs *Breakers) Success(key string) {
	bs.mu.Lock()
	k, ok := bs.keys[key]
	closed := bs.closed
	bs.mu.Unlock()
	if !ok || !k.dirty.CompareAndSwap(true, false) || closed || bs.c.Degraded() {
		return
	}
	bs.enqueue(report{reset: true, key: key}, "breaker_reset")
}

func (bs *Breakers) enqueue(r report, op string) {
	select {
	case bs.queue <- r:
	default:
		if bs.onDrop != nil {
			bs.onDrop(op)
		}
	}
}

// ProbeSuccess implements breaker.Fleet: it queues the success, with the
// probe lease this instance holds, for the fleet's recovery count. The
// script counts it only while the fleet has an open record of the key,
// and one counted under the lease extends the lease by the key's lease
// time, for this instance's next recovery probe (lease.go).
func (bs *Breakers) ProbeSuccess(key string, s breaker.Settings) {
	if bs.c.Degraded() {
		return
	}
	bs.mu.Lock()
	k, ok := bs.keys[key]
	if !ok || bs.closed {
		bs.mu.Unlock()
		return
	}
	lease, ttl := k.lease, bs.leaseTTLLocked(k)
	bs.mu.Unlock()
	bs.enqueue(report{success: true, key: key, recov: max(s.RecoverySuccesses, 1), lease: lease, leaseTTL: ttl}, "breaker_success")
}

// Reopens implements breaker.Fleet, from memory: the re-open count of the
// fleet's open record of key, as the last message or refresh left it.
func (bs *Breakers) Reopens(key string) int {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if k, ok := bs.keys[key]; ok && !bs.closed {
		return k.reopens
	}
	return 0
}

// Reopen implements breaker.Fleet: PutOpen with the fleet's re-open count.
func (bs *Breakers) Reopen(key string, until time.Time, reason string, reopens int) {
	bs.putOpen(key, until, reason, max(reopens, 0))
}

// PutOpen implements breaker.Store: this instance's copy says open at once
// (for its other breakers of the key, and those created next); the write
// and its message go in the background. The fleet's re-open count stays.
func (bs *Breakers) PutOpen(key string, until time.Time, reason string) {
	bs.putOpen(key, until, reason, -1)
}

// putOpen is PutOpen and Reopen; reopens < 0 keeps the known count.
func (bs *Breakers) putOpen(key string, until time.Time, reason string, reopens int) {
	now := time.Now()
	if !until.IsZero() && !until.After(now) {
		return
	}
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return
	}
	k := bs.keyLocked(key)
	k.open, k.until, k.reason, k.by, k.at, k.changed = true, until, reason, bs.id, 0, now
	k.dirty.Store(false) // the write starts the counts afresh
	if reopens >= 0 {
		k.reopens = reopens
	}
	bs.writes[key] = &write{open: true, until: until, reason: reason, made: now, lease: k.lease, reopens: k.reopens}
	k.lease = ""
	// This instance's open breakers of the key wait for the lease too, the
	// writer's included (the worker delivers it with the write).
	if !until.IsZero() {
		gate := bs.gateLocked(k, until)
		for _, b := range k.members {
			if b.State() == breaker.Open {
				bs.outbox = append(bs.outbox, push{b: b, open: true, until: gate, reason: reason})
			}
		}
	}
	bs.armLocked(k, until)
	bs.mu.Unlock()
	poke(bs.wake)
}

// ClearOpen implements breaker.Store: this instance's copy forgets the
// open entry at once; the write, and the message that closes the other
// instances' breakers when the fleet had the key open, go in the
// background.
func (bs *Breakers) ClearOpen(key string) {
	now := time.Now()
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return
	}
	k := bs.keyLocked(key)
	k.open, k.until, k.reason, k.by, k.at, k.changed = false, time.Time{}, "", "", 0, now
	k.reopens = 0
	k.dirty.Store(false)
	bs.writes[key] = &write{made: now, lease: k.lease}
	k.lease = ""
	bs.armLocked(k, time.Time{})
	bs.mu.Unlock()
	poke(bs.wake)
}

// OpenUntil implements breaker.Store, from memory.
func (bs *Breakers) OpenUntil(key string, now time.Time) (time.Time, string, bool) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	k, ok := bs.keys[key]
	if !ok || bs.closed || !k.openAt(now) {
		return time.Time{}, "", false
	}
	return bs.gateLocked(k, k.until), k.reason, true
}

// pushLocked queues a verdict for key's breakers here; onlyClosed limits
// it to those that are closed. An open until a time is adopted until then
// plus the key's lease time (gateLocked).
func (bs *Breakers) pushLocked(k *keyState, open bool, until time.Time, reason string, onlyClosed bool) {
	if open {
		until = bs.gateLocked(k, until)
	}
	for _, b := range k.members {
		if onlyClosed && b.State() != breaker.Closed {
			continue
		}
		bs.outbox = append(bs.outbox, push{b: b, open: open, until: until, reason: reason})
	}
}

// flush delivers the outbox, in order, one goroutine at a time, without
// any lock held (a breaker's listener may call back into the store).
func (bs *Breakers) flush() {
	for {
		if !bs.pushing.TryLock() {
			return
		}
		for {
			bs.mu.Lock()
			q := bs.outbox
			bs.outbox = nil
			bs.mu.Unlock()
			if len(q) == 0 {
				break
			}
			for _, p := range q {
				switch {
				case p.probe:
					p.b.ProbeNow(p.reason)
				case p.open:
					p.b.Adopt(p.until, p.reason)
				default:
					p.b.AdoptClose(p.reason)
				}
			}
		}
		bs.pushing.Unlock()
		bs.mu.Lock()
		more := len(bs.outbox) > 0
		bs.mu.Unlock()
		if !more {
			return
		}
	}
}

// Close stops the background work and forgets every breaker: no more
// pushes, and every call after it does nothing (OpenUntil says closed).
// Pending writes are dropped. Call it before closing the Client.
func (bs *Breakers) Close() {
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return
	}
	bs.closed = true
	for _, k := range bs.keys {
		k.dirty.Store(false)
		k.members = nil
		bs.armLocked(k, time.Time{})
	}
	bs.outbox = nil
	bs.mu.Unlock()
	bs.unhook()
	close(bs.stop)
	bs.closeSub()
	bs.wg.Wait()
}

func poke(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

var _ breaker.Fleet = (*Breakers)(nil)
