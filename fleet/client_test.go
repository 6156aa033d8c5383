package fleet

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// Fast settings for tests: local mode is reached in 3 failed ops, left
// within one refresh of Redis coming back.
const (
	testOpTimeout = 40 * time.Millisecond
	testRefresh   = 100 * time.Millisecond
)

// opRecorder is an Observer that remembers every operation.
type opRecorder struct {
	mu  sync.Mutex
	ops []string // "op kind"
}

func (r *opRecorder) OpDone(op string, _ time.Duration, kind ErrorKind) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.ops = append(r.ops, op+" "+string(kind))
}

func (r *opRecorder) count(entry string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, o := range r.ops {
		if o == entry {
			n++
		}
	}
	return n
}

// harness is a client with its logs, operations and mode switches. Its
// loop runs when the test ticks it (tick), or on its own (openTicking).
type harness struct {
	*Client
	logs  *observer.ObservedLogs
	ops   *opRecorder
	ticks chan time.Time
	mu    sync.Mutex
	modes []bool
}

// openTest opens a client whose loop runs only when the test calls tick.
func openTest(t *testing.T, cfg Config) *harness {
	t.Helper()
	return openWith(t, cfg, make(chan time.Time))
}

// openTicking opens a client whose loop runs every refresh.
func openTicking(t *testing.T, cfg Config) *harness {
	t.Helper()
	return openWith(t, cfg, nil)
}

// tick runs one round of the loop (heartbeat, or ping in local mode) and
// waits until it has started.
func (h *harness) tick() { h.ticks <- time.Now() }

func openWith(t *testing.T, cfg Config, ticks chan time.Time) *harness {
	t.Helper()
	if cfg.OpTimeout == 0 {
		cfg.OpTimeout = testOpTimeout
	}
	if cfg.Refresh == 0 {
		cfg.Refresh = testRefresh
	}
	core, logs := observer.New(zapcore.DebugLevel)
	h := &harness{logs: logs, ops: new(opRecorder), ticks: ticks}
	var tc <-chan time.Time
	if ticks != nil {
		tc = ticks
	}
	c, err := open(cfg, h.ops, zap.New(core), tc)
	if err != nil {
		t.Fatal(err)
	}
	h.Client = c
	c.OnModeChange(func(d bool) {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.modes = append(h.modes, d)
	})
	t.Cleanup(func() { _ = c.Close() })
	return h
}

func (h *harness) switches() []bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]bool(nil), h.modes...)
}

// lines returns the messages logged at level (not go-redis's debug lines).
func (h *harness) lines(level zapcore.Level) []string {
	var out []string
	for _, e := range h.logs.FilterLevelExact(level).All() {
		if e.LoggerName != "redis" {
			out = append(out, e.Message)
		}
	}
	return out
}

func set(c *Client, key, v string) error {
	return c.Do(context.Background(), "set", func(ctx context.Context, r redis.Cmdable) error {
		return r.Set(ctx, key, v, time.Minute).Err()
	})
}

func get(c *Client, key string) (string, error) {
	var v string
	err := c.Do(context.Background(), "get", func(ctx context.Context, r redis.Cmdable) error {
		var err error
		v, err = r.Get(ctx, key).Result()
		return err
	})
	return v, err
}

func waitFor(t *testing.T, what string, within time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(within); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", within, what)
		}
	}
}

func TestConnectsWithPasswordAndDB(t *testing.T) {
	s := redistest.Start(t, redistest.Options{Password: "s3cret"})
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		// op_timeout 500 ms (refresh 2 s, which a ticked test never
		// waits for): the test is of the credentials, and the first dial
		// with AUTH and SELECT took over 40 ms on a loaded machine
		// ("redis unreachable at start" in a fresh-clone run).
		{"in the URL", Config{URL: "redis://:s3cret@" + s.Addr() + "/3", OpTimeout: 500 * time.Millisecond, Refresh: 2 * time.Second}},
		{"as settings", Config{URL: "redis://" + s.Addr(), Password: "s3cret", DB: 3, OpTimeout: 500 * time.Millisecond, Refresh: 2 * time.Second}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := openTest(t, tc.cfg)
			if h.Degraded() {
				t.Fatalf("degraded after Open: %v", h.lines(zapcore.WarnLevel))
			}
			if err := set(h.Client, "k:"+tc.name, "v"); err != nil {
				t.Fatal(err)
			}
			db3 := redis.NewClient(&redis.Options{Addr: s.Addr(), Password: "s3cret", DB: 3})
			defer db3.Close()
			if v, err := db3.Get(context.Background(), "k:"+tc.name).Result(); err != nil || v != "v" {
				t.Fatalf("db 3 holds %q, %v", v, err)
			}
			if v, err := get(h.Client, "missing"); !errors.Is(err, redis.Nil) || KindOf(err) != "" || v != "" {
				t.Fatalf("a missing key: %q, %v (kind %q); want redis.Nil, no failure", v, err, KindOf(err))
			}
		})
	}
	t.Run("wrong password starts in local mode", func(t *testing.T) {
		h := openTest(t, Config{URL: "redis://" + s.Addr(), Password: "wrong"})
		if !h.Degraded() {
			t.Fatal("not degraded with a wrong password")
		}
		if got := h.ops.count("heartbeat conn"); got != 1 {
			t.Errorf("heartbeat conn counted %d times, want 1 (%v)", got, h.ops.ops)
		}
		if w := h.lines(zapcore.WarnLevel); len(w) != 1 || !strings.Contains(w[0], "local mode") {
			t.Errorf("warn lines %q", w)
		}
	})
}

func TestSentinelURLFindsTheMaster(t *testing.T) {
	m := redistest.Start(t, redistest.Options{Password: "pw"})
	sen := redistest.StartSentinel(t, m, "mymaster")
	h := openTest(t, Config{URL: "redis+sentinel://" + sen.Addr() + "/mymaster/2", Password: "pw", OpTimeout: 200 * time.Millisecond, Refresh: time.Second})
	if h.Degraded() {
		t.Fatalf("degraded: %v", h.logs.All())
	}
	if err := set(h.Client, "via-sentinel", "1"); err != nil {
		t.Fatal(err)
	}
	direct := redis.NewClient(&redis.Options{Addr: m.Addr(), Password: "pw", DB: 2})
	defer direct.Close()
	if v, err := direct.Get(context.Background(), "via-sentinel").Result(); err != nil || v != "1" {
		t.Fatalf("master db 2 holds %q, %v", v, err)
	}
}

// TestOpTimeoutBoundsEveryOperation: with Redis blackholed, an operation
// on an open connection, and opening a client (a new connection whose
// handshake never ends), each return within op_timeout and a little.
func TestOpTimeoutBoundsEveryOperation(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	p := redistest.NewProxy(t, s.Addr())
	h := openTest(t, Config{URL: "redis://" + p.Addr()})
	if err := set(h.Client, "k", "v"); err != nil {
		t.Fatal(err)
	}
	const slack = 60 * time.Millisecond
	p.Blackhole()
	start := time.Now()
	err := set(h.Client, "k", "v2")
	if took := time.Since(start); took > testOpTimeout+slack {
		t.Errorf("an op on a blackholed connection took %v, want ≤ %v", took, testOpTimeout+slack)
	}
	if KindOf(err) != KindTimeout || !Ambiguous(err) {
		t.Errorf("err %v: kind %q, ambiguous %v; want timeout, ambiguous (it was sent)", err, KindOf(err), Ambiguous(err))
	}

	start = time.Now()
	fresh := openTest(t, Config{URL: "redis://" + p.Addr()})
	if took := time.Since(start); took > testOpTimeout+slack {
		t.Errorf("Open against a blackhole took %v, want ≤ %v", took, testOpTimeout+slack)
	}
	if !fresh.Degraded() {
		t.Error("a client opened against a blackhole is not in local mode")
	}
	// In local mode nothing waits at all.
	start = time.Now()
	if err := set(fresh.Client, "k", "v"); !errors.Is(err, ErrDegraded) || Ambiguous(err) {
		t.Errorf("in local mode: %v, want ErrDegraded", err)
	}
	if took := time.Since(start); took > 5*time.Millisecond {
		t.Errorf("a refused op took %v", took)
	}
}

// TestLocalModeAfterConsecutiveFailuresAndBack: each fault — blackhole,
// slow replies, reset connections, a stopped server — switches to local
// mode after three failed operations with one warn line, and Redis's
// return switches back within a refresh or two with one info line.
func TestLocalModeAfterConsecutiveFailuresAndBack(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	p := redistest.NewProxy(t, s.Addr())
	// Not testOpTimeout: the test counts failed ops, and a 40 ms op (the
	// first dial, a ping after a restart) times out on a loaded machine,
	// failing one that the fault did not fail.
	const opTimeout = 200 * time.Millisecond
	for _, tc := range []struct {
		name  string
		fault func()
		heal  func()
		kind  ErrorKind
	}{
		{"blackhole", p.Blackhole, p.Pass, KindTimeout},
		{"slow", func() { p.Latency(3 * opTimeout) }, p.Pass, KindTimeout},
		{"reset", p.Reset, p.Pass, KindConn},
		{"stopped", s.Stop, s.Restart, KindConn},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := openTest(t, Config{URL: "redis://" + p.Addr(), OpTimeout: opTimeout, Refresh: 2 * opTimeout})
			if err := set(h.Client, "k", "v"); err != nil {
				t.Fatal(err)
			}
			tc.fault()
			var kinds []ErrorKind
			for i := 0; i < 10; i++ {
				err := set(h.Client, "k", strconv.Itoa(i))
				if errors.Is(err, ErrDegraded) {
					break
				}
				kinds = append(kinds, KindOf(err))
			}
			if len(kinds) != FailuresToDegrade {
				t.Fatalf("failed ops before local mode: %v, want %d", kinds, FailuresToDegrade)
			}
			for _, k := range kinds {
				if k != tc.kind {
					t.Errorf("kind %q, want %q (%v)", k, tc.kind, kinds)
				}
			}
			if !h.Degraded() {
				t.Fatal("not degraded")
			}
			for i := 0; i < 20; i++ {
				_ = set(h.Client, "k", "more")
			}
			if w := h.lines(zapcore.WarnLevel); len(w) != 1 || w[0] != "fleet redis unavailable, switching to local mode" {
				t.Fatalf("warn lines %q, want exactly one", w)
			}
			waitFor(t, "the hooks to hear of local mode", time.Second, func() bool { return len(h.switches()) == 1 })

			tc.heal()
			// Refreshes until the heartbeat finds Redis back, as the loop
			// runs them: the first ping after a restart may come before
			// the server answers.
			waitFor(t, "fleet mode again", 2*time.Second, func() bool {
				if h.Degraded() {
					h.tick()
				}
				return !h.Degraded()
			})
			if err := set(h.Client, "k", "back"); err != nil {
				t.Fatal(err)
			}
			if i := h.lines(zapcore.InfoLevel); len(i) != 1 || i[0] != "fleet redis available again, back to fleet mode" {
				t.Fatalf("info lines %q, want exactly one", i)
			}
			if w := h.lines(zapcore.WarnLevel); len(w) != 1 {
				t.Fatalf("warn lines %q, want still one", w)
			}
			waitFor(t, "the hooks to hear of fleet mode", time.Second, func() bool { return len(h.switches()) == 2 })
			if got := h.switches(); !got[0] || got[1] {
				t.Fatalf("mode switches %v, want [true false]", got)
			}
			if n := h.ops.count("set " + string(tc.kind)); n != FailuresToDegrade {
				t.Errorf("observer saw %d failed sets of kind %s, want %d", n, tc.kind, FailuresToDegrade)
			}
		})
	}
}

// TestTheLoopRecoversByItself: with the loop at its refresh, local mode
// ends without any caller once Redis answers, and the heartbeat (a script)
// works on a restarted Redis whose script cache is empty.
func TestTheLoopRecoversByItself(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	h := openTicking(t, Config{URL: "redis://" + s.Addr(), InstanceID: "gw-a"})
	s.Stop()
	waitFor(t, "local mode from failed heartbeats alone", 2*time.Second, h.Degraded)
	s.Restart()
	waitFor(t, "recovery", 2*time.Second, func() bool { return !h.Degraded() })
	waitFor(t, "the heartbeat on the fresh server", 2*time.Second, func() bool {
		list, err := h.Instances(context.Background())
		return err == nil && len(list) == 1 && list[0].ID == "gw-a"
	})
	if got := h.switches(); len(got) != 2 || !got[0] || got[1] {
		t.Fatalf("mode switches %v, want [true false]", got)
	}
	if w, i := h.lines(zapcore.WarnLevel), h.lines(zapcore.InfoLevel); len(w) != 1 || len(i) != 1 {
		t.Fatalf("warn %q, info %q: want one each", w, i)
	}
	if n := h.ops.count("heartbeat script"); n != 0 {
		t.Fatalf("%d heartbeats failed as script errors on the fresh server (NOSCRIPT must reload)", n)
	}
}

// TestReadonlyReconnects: a failover behind a stable address leaves the
// pooled connections on the old master, now a replica. The first write
// gets READONLY (not ambiguous, not local mode) and replaces the client,
// so the next writes all reach the new master.
func TestReadonlyReconnects(t *testing.T) {
	oldMaster, newMaster := redistest.Start(t, redistest.Options{}), redistest.Start(t, redistest.Options{})
	p := redistest.NewProxy(t, oldMaster.Addr())
	h := openTest(t, Config{URL: "redis://" + p.Addr(), OpTimeout: 200 * time.Millisecond, Refresh: time.Second})
	// Several pooled connections to the old master.
	p.Latency(20 * time.Millisecond)
	var wg sync.WaitGroup
	for i := 0; i < 6; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := set(h.Client, "warm", "1"); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	p.Pass()
	if n := h.rdb.Load().PoolStats().IdleConns; n < 3 {
		t.Fatalf("%d idle connections, want several", n)
	}
	// The failover: the old master becomes a replica, the address now leads
	// to the new one.
	if _, err := oldMaster.Do("REPLICAOF", "127.0.0.1", "1"); err != nil {
		t.Fatal(err)
	}
	p.SetTarget(newMaster.Addr())

	err := set(h.Client, "after", "x")
	if KindOf(err) != KindReadonly || Ambiguous(err) {
		t.Fatalf("first write: %v (kind %q); want readonly, not ambiguous", err, KindOf(err))
	}
	for i := 0; i < 5; i++ {
		if err := set(h.Client, "after", strconv.Itoa(i)); err != nil {
			t.Fatalf("write %d after the reconnect: %v", i, err)
		}
	}
	if v, err := newMaster.Do("GET", "after"); err != nil || v != "4" {
		t.Fatalf("the new master holds %q, %v", v, err)
	}
	if h.Degraded() {
		t.Fatal("one READONLY switched to local mode")
	}
}

// TestAReplicaIsNotARecovery: a server that answers PING but refuses
// writes (a replica) keeps the client in local mode; it recovers when the
// server takes writes again.
func TestAReplicaIsNotARecovery(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	if _, err := s.Do("REPLICAOF", "127.0.0.1", "1"); err != nil {
		t.Fatal(err)
	}
	h := openTest(t, Config{URL: "redis://" + s.Addr()})
	if !h.Degraded() || h.ops.count("heartbeat readonly") != 1 {
		t.Fatalf("degraded %v, ops %v: want local mode from a read-only start", h.Degraded(), h.ops.ops)
	}
	h.tick()
	h.tick() // the first tick has run once the second is taken
	if !h.Degraded() {
		t.Fatal("a replica ended local mode")
	}
	if _, err := s.Do("REPLICAOF", "NO", "ONE"); err != nil {
		t.Fatal(err)
	}
	h.tick()
	waitFor(t, "fleet mode once writes work", time.Second, func() bool { return !h.Degraded() })
}

func TestInstancesListsTheFleetSeenRecently(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	url := "redis://" + s.Addr()
	a := openTest(t, Config{URL: url, InstanceID: "gw-a"})
	b := openTest(t, Config{URL: url, InstanceID: "gw-b"})
	other := openTest(t, Config{URL: url, InstanceID: "gw-x", KeyPrefix: "otherfleet:"})

	// An instance that stopped beating long ago is not listed.
	now, err := s.Do("TIME")
	if err != nil {
		t.Fatal(err)
	}
	sec, _ := strconv.ParseInt(strings.Split(now, "\n")[0], 10, 64)
	if _, err := s.Do("ZADD", "llmproxy:{instances}", strconv.FormatInt((sec-60)*1000, 10), "gw-dead"); err != nil {
		t.Fatal(err)
	}

	ids := func(c *harness) []string {
		t.Helper()
		list, err := c.Instances(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, in := range list {
			if time.Since(in.LastSeen) > time.Minute || in.LastSeen.After(time.Now().Add(time.Minute)) {
				t.Errorf("%s last seen %v", in.ID, in.LastSeen)
			}
			out = append(out, in.ID)
		}
		return out
	}
	waitFor(t, "both instances listed", time.Second, func() bool { return len(ids(a)) == 2 })
	if got := strings.Join(ids(b), ","); got != "gw-a,gw-b" && got != "gw-b,gw-a" {
		t.Fatalf("instances %s, want gw-a and gw-b", got)
	}
	if got := strings.Join(ids(other), ","); got != "gw-x" {
		t.Fatalf("another prefix lists %s, want only gw-x", got)
	}
	if ttl, err := s.Do("PTTL", "llmproxy:{instances}:gw-a"); err != nil || ttl == "-1" || ttl == "-2" {
		t.Fatalf("heartbeat key PTTL %s, %v: want a time-to-live", ttl, err)
	}

	// Close removes the instance at once.
	_ = b.Close()
	if got := strings.Join(ids(a), ","); got != "gw-a" {
		t.Fatalf("after gw-b closed: %s", got)
	}
	if v, _ := s.Do("EXISTS", "llmproxy:{instances}:gw-b"); v != "0" {
		t.Fatal("gw-b's heartbeat key is still there")
	}
}

func TestOnModeChangeRemove(t *testing.T) {
	c := &Client{hooks: make(map[int]func(bool))}
	var got []string
	remove := c.OnModeChange(func(d bool) { got = append(got, "a") })
	c.OnModeChange(func(d bool) { got = append(got, "b") })
	c.degraded.Store(true)
	c.deliver()
	c.deliver() // once per switch
	remove()
	c.degraded.Store(false)
	c.deliver()
	if strings.Join(got, "") != "abb" {
		t.Fatalf("hooks ran %q, want abb", got)
	}
}

func TestCloseIsIdempotentAndStopsTheLoop(t *testing.T) {
	s := redistest.Start(t, redistest.Options{})
	c, err := Open(Config{URL: "redis://" + s.Addr(), OpTimeout: testOpTimeout, Refresh: testRefresh}, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	_ = c.Close()
	select {
	case <-c.done:
	default:
		t.Fatal("loop still running")
	}
	if err := set(c, "k", "v"); !errors.Is(err, ErrClosed) {
		t.Fatalf("op after Close: %v, want ErrClosed", err)
	}
}
