package fleet

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Defaults of LimitsConfig.
const (
	DefaultLeaseTTL   = 10 * time.Second
	DefaultRenewEvery = 3 * time.Second
)

// maxPending bounds the settlements waiting to be sent again.
const maxPending = 10000

// LimitsConfig tunes Limits; zero values take their defaults.
type LimitsConfig struct {
	// LeaseTTL is a concurrency slot's time-to-live in Redis: a slot whose
	// instance stopped renewing it (crashed, partitioned away) is free
	// again within this long. Default 10s.
	LeaseTTL time.Duration
	// RenewEvery is how often the leases of running requests are renewed
	// (and settlements that could not be sent are sent again). Less than
	// LeaseTTL / 2, so one renewal may fail without losing a lease.
	// Default 3s.
	RenewEvery time.Duration
	// Clock is the local fallback's; nil is the system clock.
	Clock clock.Clock

	// window is the rolling window of rpm and tpm (60 slots): a minute,
	// shorter in tests.
	window time.Duration
}

// Limits is admission.LimitStore shared by the fleet through Redis
// (DESIGN §9): each tenant's rpm and tpm are one sliding window in Redis
// and its concurrency slots leases in a sorted set, decided by scripts on
// Redis's clock, so a tier's limits hold for each tenant across every
// gateway. Admission is one round trip (EVALSHA), settlement at most one.
//
// Fail-open: while the client is in local mode, or when an operation fails
// or times out (no request waits longer than OpTimeout), a request is
// decided on this gateway's share of the limits — the fleet's ÷
// ExpectedInstances — in local counters that start from zero each time
// the client goes into local mode; a fail_closed tier's request is refused
// with 503 instead. An admission whose reply was lost (Ambiguous) is never
// sent again: it may have been counted, so its cancellation — keyed by its
// request id, a no-op when nothing was counted or it is cancelled already
// — is sent when Redis answers, and the request itself is decided locally.
// A settlement that could not be sent is kept and sent again (it is keyed
// by its request id as well: a replay is a no-op) at each renewal, for up
// to one window.
type Limits struct {
	c        *Client
	cfg      LimitsConfig
	prefix   string // "<instance>/<random>.": request ids
	seq      atomic.Uint64
	slotMs   int64
	slots    int
	holdTTL  int64 // ms
	doneTTL  int64 // ms
	retry    time.Duration
	fallback atomic.Pointer[admission.LocalLimits]
	unhook   func()

	mu      sync.Mutex
	leases  map[string]map[string]struct{} // tenant → lease ids of running requests
	pending []pendingSettle
	sending int // pending settlements being sent by flush

	stop     chan struct{}
	done     chan struct{}
	stopOnce sync.Once
}

// pendingSettle is a settlement or cancellation to send again.
type pendingSettle struct {
	tenant, id string
	used       int64
	cancel     bool
	since      time.Time
}

// remoteHold is an admission.Hold's Ref for a request that Redis admitted.
type remoteHold struct {
	tenant string
	leased bool
}

// NewLimits returns the fleet's limit store over c, renewing its leases
// until Close or until c is closed.
func NewLimits(c *Client, cfg LimitsConfig) (*Limits, error) {
	if cfg.LeaseTTL == 0 {
		cfg.LeaseTTL = DefaultLeaseTTL
	}
	if cfg.RenewEvery == 0 {
		cfg.RenewEvery = min(DefaultRenewEvery, cfg.LeaseTTL*3/10)
	}
	if cfg.window == 0 {
		cfg.window = time.Minute
	}
	switch {
	case cfg.LeaseTTL < time.Millisecond:
		return nil, errors.New("fleet limits: lease ttl " + cfg.LeaseTTL.String() + ": want at least 1ms")
	case cfg.RenewEvery <= 0 || cfg.RenewEvery >= cfg.LeaseTTL/2:
		return nil, errors.New("fleet limits: renew every " + cfg.RenewEvery.String() + ": want more than 0 and less than half the lease ttl " + cfg.LeaseTTL.String())
	}
	var nonce [6]byte
	_, _ = rand.Read(nonce[:])
	l := &Limits{
		c:      c,
		cfg:    cfg,
		prefix: c.InstanceID() + "/" + hex.EncodeToString(nonce[:]) + ".",
		slots:  60,
		leases: make(map[string]map[string]struct{}),
		stop:   make(chan struct{}),
		done:   make(chan struct{}),
	}
	l.slotMs = max(1, cfg.window.Milliseconds()/int64(l.slots))
	window := time.Duration(l.slotMs*int64(l.slots)) * time.Millisecond
	l.holdTTL = (window + 2*time.Duration(l.slotMs)*time.Millisecond).Milliseconds()
	// A settlement is sent again for at most one window after its first
	// try; its done mark outlives that.
	l.doneTTL = (window + 2*cfg.LeaseTTL).Milliseconds()
	l.retry = max(time.Second, c.Config().Refresh)
	l.fallback.Store(admission.NewLocalLimits(cfg.Clock))
	l.unhook = c.OnModeChange(func(degraded bool) {
		if degraded {
			// Local mode starts from zero: the fleet's counts are not
			// this gateway's to carry.
			l.fallback.Store(admission.NewLocalLimits(l.cfg.Clock))
			return
		}
		l.flush(context.Background())
	})
	go l.loop()
	return l, nil
}

// Close stops renewing leases (the requests still running lose their
// slots within one lease ttl) and unregisters from the client. Calling it
// again does nothing.
func (l *Limits) Close() {
	l.stopOnce.Do(func() {
		close(l.stop)
		<-l.done
		l.unhook()
	})
}

// Done is closed once the store has stopped: Close, or its client closed.
func (l *Limits) Done() <-chan struct{} { return l.done }

// Client is the connection the store uses.
func (l *Limits) Client() *Client { return l.c }

// Leases returns the number of leases this store is renewing now.
func (l *Limits) Leases() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, ids := range l.leases {
		n += len(ids)
	}
	return n
}

// inFlightScript counts a tenant's unexpired leases on Redis's clock:
// KEYS leases.
const inFlightScript = `
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
return redis.call('ZCOUNT', KEYS[1], '(' .. now, '+inf')
`

// InFlight returns the fleet's in-flight requests of each of tenants: its
// unexpired concurrency leases in Redis, over every gateway (only a tenant
// with max_concurrent takes leases: any other counts 0). One
// pipelined round trip, bounded by Config.OpTimeout; ErrDegraded in local
// mode. For the admin API, off the request path.
func (l *Limits) InFlight(ctx context.Context, tenants []string) (map[string]int, error) {
	if len(tenants) == 0 {
		return map[string]int{}, nil
	}
	cmds := make([]*redis.Cmd, len(tenants))
	err := l.c.Do(ctx, "limits_inflight", func(ctx context.Context, r redis.Cmdable) error {
		_, err := r.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, id := range tenants {
				cmds[i] = p.Eval(ctx, inFlightScript, []string{l.c.Key("tenant:"+id, "leases")})
			}
			return nil
		})
		return err
	})
	if err != nil {
		return nil, err
	}
	out := make(map[string]int, len(tenants))
	for i, id := range tenants {
		if n, err := cmds[i].Int(); err == nil {
			out[id] = n
		}
	}
	return out, nil
}

// Pending returns the number of settlements waiting to be sent again
// (being sent included).
func (l *Limits) Pending() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.pending) + l.sending
}

func (l *Limits) loop() {
	defer close(l.done)
	t := time.NewTicker(l.cfg.RenewEvery)
	defer t.Stop()
	for {
		select {
		case <-l.stop:
			return
		case <-l.c.stop:
			l.unhook()
			return
		case <-t.C:
			if !l.c.Degraded() {
				l.renew(context.Background())
				l.flush(context.Background())
			}
		}
	}
}

// keys are a request's keys: window, leases, hold, done.
func (l *Limits) keys(tenant, id string) []string {
	obj := "tenant:" + tenant
	return []string{l.c.Key(obj, "win"), l.c.Key(obj, "leases"), l.c.Key(obj, "hold", id), l.c.Key(obj, "done", id)}
}

// Reserve implements admission.LimitStore: one script on Redis, or the
// local fallback when Redis is away.
func (l *Limits) Reserve(q *admission.Quota, h *admission.Hold) admission.Decision {
	if l.c.Degraded() {
		return l.local(q, h)
	}
	id := l.prefix + strconv.FormatUint(l.seq.Add(1), 36)
	explicit := "0"
	if q.Explicit {
		explicit = "1"
	}
	var v []int64
	err := l.c.Do(context.Background(), "limits_reserve", func(ctx context.Context, r redis.Cmdable) error {
		var err error
		v, err = reserveScript.Run(ctx, r, l.keys(q.Tenant, id), id, q.MaxConcurrent, q.RPM, q.TPM,
			q.Prompt, q.Need, explicit, l.cfg.LeaseTTL.Milliseconds(), l.slotMs, l.slots, l.holdTTL).Int64Slice()
		return err
	})
	if err == nil && (len(v) != 8 || v[0] == 5) {
		err = errors.New("fleet limits_reserve: unexpected reply") // not counted: no hold
	}
	if err != nil {
		if Ambiguous(err) {
			// It may have been counted: take it back once Redis answers,
			// keyed by its id (a no-op if it never ran); never run it again.
			l.enqueue(pendingSettle{tenant: q.Tenant, id: id, cancel: true, since: time.Now()})
		}
		if ce := l.c.log.Check(zap.DebugLevel, "fleet limits: reserve failed, deciding locally"); ce != nil {
			ce.Write(zap.String("tenant", q.Tenant), zap.Error(err))
		}
		return l.local(q, h)
	}
	d := admission.Decision{
		RetryAfter: time.Duration(v[1]) * time.Millisecond, Reserved: v[2], Left: v[3],
		Requests: v[4], Tokens: v[5],
		ResetRequests: time.Duration(v[6]) * time.Millisecond, ResetTokens: time.Duration(v[7]) * time.Millisecond,
	}
	switch v[0] {
	case 0:
		rh := &remoteHold{tenant: q.Tenant, leased: q.MaxConcurrent > 0}
		h.Reserved, h.ID, h.Ref = d.Reserved, id, rh
		if rh.leased {
			l.mu.Lock()
			ids := l.leases[q.Tenant]
			if ids == nil {
				ids = make(map[string]struct{})
				l.leases[q.Tenant] = ids
			}
			ids[id] = struct{}{}
			l.mu.Unlock()
		}
	case 1:
		d.Code = admission.CodeTenantConcurrency
	case 2:
		d.Code = admission.CodeTenantRPM
	case 3:
		d.Code = admission.CodeTenantTPM
	default:
		d.Code = admission.CodeRequestExceedsLimit
	}
	return d
}

// local decides q on this gateway's share of the limits (or refuses a
// fail_closed tier's request).
func (l *Limits) local(q *admission.Quota, h *admission.Hold) admission.Decision {
	return admission.ReserveShare(l.fallback.Load(), l.c.Config().ExpectedInstances, l.retry, q, h)
}

// Settle implements admission.LimitStore.
func (l *Limits) Settle(h *admission.Hold, used int64) { l.give(h, used, false) }

// Cancel implements admission.LimitStore.
func (l *Limits) Cancel(h *admission.Hold) { l.give(h, 0, true) }

func (l *Limits) give(h *admission.Hold, used int64, cancel bool) {
	switch ref := h.Ref.(type) {
	case *admission.LocalLimits:
		if cancel {
			ref.Cancel(h)
		} else {
			ref.Settle(h, used)
		}
	case *remoteHold:
		if ref.leased {
			l.mu.Lock()
			if ids := l.leases[ref.tenant]; ids != nil {
				delete(ids, h.ID)
				if len(ids) == 0 {
					delete(l.leases, ref.tenant)
				}
			}
			l.mu.Unlock()
		}
		p := pendingSettle{tenant: ref.tenant, id: h.ID, used: used, cancel: cancel, since: time.Now()}
		if err := l.send(context.Background(), p); err != nil {
			// Not sent, or its reply lost: send it again later (a replay
			// of an applied one is a no-op). Its lease, no longer
			// renewed, frees itself within one lease ttl meanwhile.
			l.enqueue(p)
		}
	}
	h.Ref = nil
}

// send runs one settlement.
func (l *Limits) send(ctx context.Context, p pendingSettle) error {
	return l.c.Do(ctx, "limits_settle", func(ctx context.Context, r redis.Cmdable) error {
		return settleScript.Run(ctx, r, l.keys(p.tenant, p.id), l.settleArgs(p)...).Err()
	})
}

func (l *Limits) settleArgs(p pendingSettle) []any {
	cancel := "0"
	if p.cancel {
		cancel = "1"
	}
	return []any{p.id, p.used, cancel, l.slotMs, l.slots, l.doneTTL}
}

func (l *Limits) enqueue(p pendingSettle) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.pending) >= maxPending {
		l.pending = l.pending[1:] // the oldest: its tokens have nearly left the window
	}
	l.pending = append(l.pending, p)
}

// window is the rolling window's length.
func (l *Limits) window() time.Duration {
	return time.Duration(l.slotMs*int64(l.slots)) * time.Millisecond
}

// flush sends the pending settlements again, in one pipeline; those that
// fail stay for the next try, those older than a window are dropped (their
// done mark may be gone: a replay could count twice).
func (l *Limits) flush(ctx context.Context) {
	l.mu.Lock()
	ps := l.pending
	l.pending = nil
	l.sending += len(ps)
	l.mu.Unlock()
	if len(ps) == 0 {
		return
	}
	sent := len(ps)
	defer func() {
		l.mu.Lock()
		l.sending -= sent
		l.mu.Unlock()
	}()
	cutoff := time.Now().Add(-l.window())
	keep := ps[:0]
	for _, p := range ps {
		if p.since.After(cutoff) {
			keep = append(keep, p)
		}
	}
	ps = keep
	failed := ps
	_ = l.c.Do(ctx, "limits_settle", func(ctx context.Context, r redis.Cmdable) error {
		errs, err := runScripts(ctx, r, settleScript, len(ps), func(i int) ([]string, []any) {
			return l.keys(ps[i].tenant, ps[i].id), l.settleArgs(ps[i])
		})
		failed = failed[:0]
		for i, e := range errs {
			if e != nil {
				failed = append(failed, ps[i])
			}
		}
		return err
	})
	if len(failed) > 0 {
		l.mu.Lock()
		l.pending = append(failed, l.pending...)
		if len(l.pending) > maxPending {
			l.pending = l.pending[len(l.pending)-maxPending:]
		}
		l.mu.Unlock()
	}
}

// renew renews the leases of the requests running here, one script per
// tenant in one pipeline; leases found gone are no longer renewed.
func (l *Limits) renew(ctx context.Context) {
	l.mu.Lock()
	type batch struct {
		tenant string
		ids    []any
	}
	bs := make([]batch, 0, len(l.leases))
	for tenant, ids := range l.leases {
		b := batch{tenant: tenant, ids: make([]any, 0, len(ids)+1)}
		b.ids = append(b.ids, l.cfg.LeaseTTL.Milliseconds())
		for id := range ids {
			b.ids = append(b.ids, id)
		}
		bs = append(bs, b)
	}
	l.mu.Unlock()
	if len(bs) == 0 {
		return
	}
	var cmds []*redis.Cmd
	_ = l.c.Do(ctx, "limits_renew", func(ctx context.Context, r redis.Cmdable) error {
		var err error
		cmds, err = runScriptCmds(ctx, r, renewScript, len(bs), func(i int) ([]string, []any) {
			return []string{l.c.Key("tenant:"+bs[i].tenant, "leases")}, bs[i].ids
		})
		return err
	})
	lost := 0
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		gone, err := cmd.StringSlice()
		if err != nil || len(gone) == 0 {
			continue
		}
		lost += len(gone)
		l.mu.Lock()
		if ids := l.leases[bs[i].tenant]; ids != nil {
			for _, id := range gone {
				delete(ids, id)
			}
			if len(ids) == 0 {
				delete(l.leases, bs[i].tenant)
			}
		}
		l.mu.Unlock()
	}
	if lost > 0 {
		l.c.log.Info("fleet limits: concurrency leases of running requests had expired, no longer counted fleet-wide",
			zap.Int("leases", lost))
	}
}

// runScripts runs n calls of s in one pipeline (EVALSHA; the calls that
// find the script cache empty again with EVAL, in a second one) and
// returns each call's error.
func runScripts(ctx context.Context, r redis.Cmdable, s *redis.Script, n int, call func(i int) ([]string, []any)) ([]error, error) {
	cmds, err := runScriptCmds(ctx, r, s, n, call)
	errs := make([]error, n)
	for i, c := range cmds {
		switch {
		case err != nil || c == nil:
			// The connection failed: a call may show no error of its own
			// (never written), and none is known to have run.
			errs[i] = err
		default:
			errs[i] = c.Err()
		}
	}
	return errs, err
}

// runScriptCmds is runScripts returning the commands (nil for a call that
// was not run).
func runScriptCmds(ctx context.Context, r redis.Cmdable, s *redis.Script, n int, call func(i int) ([]string, []any)) ([]*redis.Cmd, error) {
	cmds := make([]*redis.Cmd, n)
	_, err := r.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range n {
			keys, args := call(i)
			cmds[i] = s.EvalSha(ctx, p, keys, args...)
		}
		return nil
	})
	var again []int
	for i, c := range cmds {
		if e := c.Err(); e != nil && redis.HasErrorPrefix(e, "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		_, err = r.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, i := range again {
				keys, args := call(i)
				cmds[i] = s.Eval(ctx, p, keys, args...)
			}
			return nil
		})
	}
	if err != nil && !isReplyError(err) {
		return cmds, err
	}
	return cmds, firstConnError(cmds)
}

// isReplyError reports whether err is an error reply from Redis (Redis
// answered), not a failed connection.
func isReplyError(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && !errors.Is(err, redis.Nil)
}

// firstConnError returns the first error of cmds that is not a reply
// (Redis did not answer), nil when Redis answered them all.
func firstConnError(cmds []*redis.Cmd) error {
	for _, c := range cmds {
		if c == nil {
			continue
		}
		if e := c.Err(); e != nil && !isReplyError(e) {
			return e
		}
	}
	return nil
}

// Interface guard.
var _ admission.LimitStore = (*Limits)(nil)
