package fleet

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// FailuresToDegrade is how many operations in a row must fail (time out,
// lose their connection, hit a read-only replica) before the client
// switches to local mode.
const FailuresToDegrade = 3

// Observer receives the client's measurements. It must be safe for
// concurrent use and quick: OpDone runs on the caller's path.
type Observer interface {
	// OpDone reports one operation through Do (or the client's own:
	// "heartbeat", "instances", "leave") with its latency, and its
	// error's kind, "" on success. Operations refused in local mode and
	// those the caller cancelled are not reported.
	OpDone(op string, took time.Duration, kind ErrorKind)
}

type nopObserver struct{}

func (nopObserver) OpDone(string, time.Duration, ErrorKind) {}

// Client is one instance's connection to the fleet's Redis, with a health
// state machine: after FailuresToDegrade failed operations in a row it is
// in local mode (Degraded) — Do refuses at once with ErrDegraded, so no
// request waits on a Redis that is away — until the heartbeat, tried every
// Refresh, succeeds again. Each switch is logged once (warn into local
// mode, info out of it) and handed to the OnModeChange hooks.
//
// It writes this instance's heartbeat every Refresh. Safe for concurrent
// use.
type Client struct {
	cfg  Config
	obs  Observer
	log  *zap.Logger
	opts *redis.UniversalOptions
	rdb  atomic.Pointer[rdbConn]

	degraded      atomic.Bool
	failures      atomic.Int32
	lastReconnect atomic.Int64 // unix nanoseconds
	since         atomic.Int64 // unix nanoseconds of the last switch

	hooksMu sync.Mutex
	hooks   map[int]func(degraded bool)
	nextID  int

	closed    atomic.Bool
	poke      chan struct{}
	stop      chan struct{}
	done      chan struct{}
	closeOnce sync.Once
	delivered bool // the mode last handed to the hooks; loop goroutine only
}

// Open connects to Redis as cfg says (after Defaults) and starts the
// background loop. It fails only on an invalid configuration: when Redis
// cannot be reached, the client starts in local mode (fail-open) and
// recovers when Redis answers. obs may be nil; logger may be nil (no logs).
func Open(cfg Config, obs Observer, logger *zap.Logger) (*Client, error) {
	return open(cfg, obs, logger, nil)
}

// open is Open with the loop driven by ticks (tests), or by a ticker of
// Refresh when ticks is nil.
func open(cfg Config, obs Observer, logger *zap.Logger, ticks <-chan time.Time) (*Client, error) {
	cfg = cfg.Defaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	opts, _ := cfg.redisOptions()
	if obs == nil {
		obs = nopObserver{}
	}
	if logger == nil {
		logger = zap.NewNop()
	}
	logger = logger.With(zap.String("instance_id", cfg.InstanceID))
	setRedisLogger(logger)
	c := &Client{
		cfg:   cfg,
		obs:   obs,
		log:   logger,
		opts:  opts,
		hooks: make(map[int]func(bool)),
		poke:  make(chan struct{}, 1),
		stop:  make(chan struct{}),
		done:  make(chan struct{}),
	}
	c.rdb.Store(newRedis(opts))
	c.since.Store(time.Now().UnixNano())

	if err := c.heartbeat(context.Background()); err != nil && KindOf(err).unhealthy() {
		c.degraded.Store(true)
		c.delivered = true
		c.log.Warn("fleet redis unreachable at start, running in local mode",
			zap.String("redis", redact(cfg.URL)), zap.Error(err))
	}
	var ticker *time.Ticker
	if ticks == nil {
		ticker = time.NewTicker(cfg.Refresh)
		ticks = ticker.C
	}
	go c.loop(ticks, ticker)
	return c, nil
}

// InstanceID is this instance's id in the fleet (Config.InstanceID, or
// the generated default).
func (c *Client) InstanceID() string { return c.cfg.InstanceID }

// Config is the configuration in effect, defaults applied.
func (c *Client) Config() Config { return c.cfg }

// Degraded reports whether the client is in local mode. It never blocks
// and never allocates.
func (c *Client) Degraded() bool { return c.degraded.Load() }

// Since is when the client last switched mode (or opened).
func (c *Client) Since() time.Time { return time.Unix(0, c.since.Load()) }

// OnModeChange registers fn to be called with the new mode after each
// switch (true: into local mode; false: back to fleet mode), in order,
// once per switch, on the client's background goroutine: it should be
// quick, may use Do (after recovery, to reconcile) and must not call
// Close. The returned function unregisters it.
func (c *Client) OnModeChange(fn func(degraded bool)) (remove func()) {
	c.hooksMu.Lock()
	defer c.hooksMu.Unlock()
	id := c.nextID
	c.nextID++
	c.hooks[id] = fn
	return func() {
		c.hooksMu.Lock()
		defer c.hooksMu.Unlock()
		delete(c.hooks, id)
	}
}

// Do runs fn against Redis with a context bounded by OpTimeout (and by
// ctx), and counts its outcome under op, a short constant name such as
// "breaker_report" (a metric label). fn should make one round trip (a
// command, a pipeline or a script) and return go-redis's error.
//
// In local mode it returns ErrDegraded at once without calling fn. A
// failure is returned as an *OpError (see KindOf); redis.Nil and fn's
// success are returned as they are. A failure may still have been applied
// (see Ambiguous): never replay it blindly.
func (c *Client) Do(ctx context.Context, op string, fn func(ctx context.Context, r redis.Cmdable) error) error {
	if c.degraded.Load() {
		return ErrDegraded
	}
	return c.run(ctx, op, fn)
}

// run is Do without the local-mode check: the heartbeat uses it to find
// out whether Redis is back. After Close it returns ErrClosed.
func (c *Client) run(ctx context.Context, op string, fn func(ctx context.Context, r redis.Cmdable) error) error {
	if c.closed.Load() {
		return ErrClosed
	}
	octx, cancel := context.WithTimeout(ctx, c.cfg.OpTimeout)
	defer cancel()
	start := time.Now()
	err := unwrapSent(fn(octx, c.rdb.Load()))
	took := time.Since(start)
	kind, callerDone := classify(ctx, err)
	if callerDone {
		return err
	}
	c.obs.OpDone(op, took, kind)
	if kind == "" {
		c.failures.Store(0)
		return err
	}
	oe := &OpError{Op: op, Kind: kind, Err: err}
	if !kind.unhealthy() {
		c.failures.Store(0) // Redis answered
		return oe
	}
	if kind == KindReadonly && !c.opts.IsClusterMode {
		c.reconnect() // a Cluster client reloads its slot map itself
	}
	if n := c.failures.Add(1); n >= FailuresToDegrade && c.degraded.CompareAndSwap(false, true) {
		c.since.Store(time.Now().UnixNano())
		c.log.Warn("fleet redis unavailable, switching to local mode",
			zap.String("redis", redact(c.cfg.URL)), zap.Int("consecutive_failures", int(n)),
			zap.String("op", op), zap.String("kind", string(kind)), zap.Error(err))
		select {
		case c.poke <- struct{}{}:
		default:
		}
	}
	return oe
}

// reconnect replaces the go-redis client after a READONLY reply: every
// pooled connection may lead to the old master, and a fresh client dials
// again (asking the Sentinels for the master). Not for a Cluster, whose
// client reloads the slot map on READONLY, MOVED and ASK. At most once per Refresh.
// The old client is closed once the operations still on it are over.
func (c *Client) reconnect() {
	now := time.Now().UnixNano()
	last := c.lastReconnect.Load()
	if now-last < int64(c.cfg.Refresh) || !c.lastReconnect.CompareAndSwap(last, now) {
		return
	}
	select {
	case <-c.stop:
		return // closing: the loop has closed, or will close, the current one
	default:
	}
	old := c.rdb.Swap(newRedis(c.opts))
	c.log.Info("fleet redis answered read-only (a replica), reconnecting", zap.String("redis", redact(c.cfg.URL)))
	time.AfterFunc(2*c.cfg.OpTimeout, func() { _ = old.Close() })
}

// rdbConn is one go-redis client: a *redis.Client (plain, TLS, Sentinel)
// or a *redis.ClusterClient. Replaced as a whole by reconnect.
type rdbConn struct{ redis.UniversalClient }

// newRedis builds the go-redis client the options describe: a Cluster
// client, a Sentinel failover client when they name a master, else a
// plain (or TLS) one.
func newRedis(o *redis.UniversalOptions) *rdbConn {
	switch {
	case o.IsClusterMode:
		co := o.Cluster()
		co.NewClient = func(no *redis.Options) *redis.Client {
			nc := redis.NewClient(no)
			nc.AddHook(noReplay{})
			return nc
		}
		return &rdbConn{redis.NewClusterClient(co)}
	case o.MasterName != "":
		return &rdbConn{redis.NewFailoverClient(o.Failover())}
	}
	return &rdbConn{redis.NewClient(o.Simple())}
}

// noReplay keeps the Cluster client from replaying a command whose
// connection failed after it was sent: go-redis retries such a command
// within its redirect budget (MaxRedirects also counts retries), and a
// replayed increment or reservation counts twice. A node's error of that
// kind is wrapped in a sentError, which go-redis does not recognise as
// retriable; run unwraps it. Refused dials, pool timeouts and error
// replies (MOVED, ASK, TRYAGAIN: not applied) go on as they are.
// Pipelines are left alone: the fleet's pipelines are idempotent (reads,
// DEL, ZADD XX, settlements keyed by request).
type noReplay struct{}

func (noReplay) DialHook(next redis.DialHook) redis.DialHook { return next }

func (noReplay) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func (noReplay) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, redis.ErrPoolTimeout) || isDial(err) {
			return err
		}
		var re redis.Error
		if errors.As(err, &re) || errors.Is(err, redis.ErrClosed) {
			return err
		}
		se := &sentError{err}
		cmd.SetErr(se)
		return se
	}
}

// sentError hides a connection failure after sending from go-redis's
// retry logic: it has no Unwrap, Timeout or known prefix.
type sentError struct{ err error }

func (e *sentError) Error() string { return "fleet: lost after sending: " + e.err.Error() }

// unwrapSent returns the error a sentError hides, or err.
func unwrapSent(err error) error {
	var se *sentError
	if err != nil && errors.As(err, &se) {
		return se.err
	}
	return err
}

// loop runs every Refresh until Close: the heartbeat, which also ends
// local mode when it succeeds; and hands mode switches to the hooks.
func (c *Client) loop(ticks <-chan time.Time, ticker *time.Ticker) {
	defer close(c.done)
	if ticker != nil {
		defer ticker.Stop()
	}
	for {
		select {
		case <-c.stop:
			return
		case <-c.poke:
		case <-ticks:
			if c.degraded.Load() {
				c.deliver()
				c.tryRecover()
			} else {
				_ = c.heartbeat(context.Background())
			}
		}
		c.deliver()
	}
}

// tryRecover writes the heartbeat and, when Redis takes it, ends local
// mode. A write, not a PING: a replica answers PING but not writes.
func (c *Client) tryRecover() {
	if err := c.heartbeat(context.Background()); err != nil && KindOf(err).unhealthy() {
		return
	}
	c.failures.Store(0)
	down := time.Since(c.Since())
	c.since.Store(time.Now().UnixNano())
	c.degraded.Store(false)
	c.log.Info("fleet redis available again, back to fleet mode",
		zap.String("redis", redact(c.cfg.URL)), zap.Duration("local_for", down))
}

// deliver hands the current mode to the hooks if it is not the one they
// were last given.
func (c *Client) deliver() {
	d := c.degraded.Load()
	if d == c.delivered {
		return
	}
	c.delivered = d
	c.hooksMu.Lock()
	hooks := make([]func(bool), 0, len(c.hooks))
	for id := 0; id < c.nextID; id++ {
		if h, ok := c.hooks[id]; ok {
			hooks = append(hooks, h)
		}
	}
	c.hooksMu.Unlock()
	for _, h := range hooks {
		h(d)
	}
}

// Close stops the background loop, removes this instance's heartbeat
// (when Redis is reachable) and closes the connections. Do returns
// ErrClosed after it. Calling it again does nothing.
func (c *Client) Close() error {
	var err error
	c.closeOnce.Do(func() {
		close(c.stop)
		<-c.done
		if !c.degraded.Load() {
			_ = c.leave(context.Background())
		}
		c.closed.Store(true)
		err = c.rdb.Load().Close()
	})
	return err
}

// redisLogger sends go-redis's own log lines (failed dials, pool events)
// to the newest client's logger at debug level, never to stderr.
type redisLogger struct{ l atomic.Pointer[zap.Logger] }

var redisLogs redisLogger
var redisLogsOnce sync.Once

func (r *redisLogger) Printf(_ context.Context, format string, v ...any) {
	if l := r.l.Load(); l != nil {
		l.Sugar().Debugf(format, v...)
	}
}

func setRedisLogger(l *zap.Logger) {
	redisLogs.l.Store(l.Named("redis"))
	redisLogsOnce.Do(func() { redis.SetLogger(&redisLogs) })
}
