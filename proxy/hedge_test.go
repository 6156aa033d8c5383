package proxy

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// fakeRetries is a budget with a switch and a fixed backoff.
type fakeRetries struct {
	allow   bool
	backoff time.Duration
	granted atomic.Int64
}

func (f *fakeRetries) Request() {}
func (f *fakeRetries) TryRetry() bool {
	if f.allow {
		f.granted.Add(1)
	}
	return f.allow
}
func (f *fakeRetries) Backoff(n int, retryAfter, remaining time.Duration) (time.Duration, bool) {
	return max(f.backoff, retryAfter), true
}

// fakeHedging hedges after a fixed delay while its cap allows.
type fakeHedging struct {
	delay    time.Duration
	allow    bool
	observed atomic.Int64
}

func (f *fakeHedging) Delay(RequestInfo) (time.Duration, bool) { return f.delay, true }
func (f *fakeHedging) Request()                                {}
func (f *fakeHedging) TryHedge() bool                          { return f.allow }
func (f *fakeHedging) Observe(RequestInfo, time.Duration)      { f.observed.Add(1) }
func (f *fakeHedging) MaxHedges() int                          { return 1 }

// closedBalancer marks every upstream's breaker closed so hedges may go.
type closedBalancer struct{ *listBalancer }

func (b closedBalancer) Pick(w http.ResponseWriter, r *http.Request, req PickRequest) (Upstream, error) {
	if req.Hedge && len(req.Tried) >= len(b.addrs) {
		return Upstream{}, ErrNoUpstream
	}
	up, err := b.listBalancer.Pick(w, r, req)
	up.Closed = true
	return up, err
}

func hedgedProxy(t *testing.T, cfg Config, ups ...*upstream) (*Proxy, *recordingObserver) {
	t.Helper()
	lb := &listBalancer{}
	for _, u := range ups {
		lb.addrs = append(lb.addrs, u.addr())
	}
	obs := &recordingObserver{}
	cfg.Transport = schemeTransport{http.DefaultTransport}
	cfg.Balancer = closedBalancer{lb}
	cfg.Observer = obs
	if cfg.MaxAttempts == 0 {
		cfg.MaxAttempts = 3
	}
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p, obs
}

// serve runs p.ServeHTTP in its own goroutine, so that the test can drive
// the fake clock meanwhile.
func serve(p *Proxy, w http.ResponseWriter, r *http.Request) <-chan *Result {
	done := make(chan *Result, 1)
	go func() { done <- p.ServeHTTP(w, r) }()
	return done
}

// result waits for a served request, failing the test after 5s.
func result(t *testing.T, done <-chan *Result) *Result {
	t.Helper()
	select {
	case res := <-done:
		return res
	case <-time.After(5 * time.Second):
		t.Fatal("request not finished within 5s")
		return nil
	}
}

// await waits for ch to close, failing the test after 5s.
func await(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(5 * time.Second):
		t.Fatalf("%s: not within 5s", what)
	}
}

func TestHedgeFirstEventWinsAndLoserIsCancelled(t *testing.T) {
	primaryStarted, primaryCancelled := make(chan struct{}), make(chan struct{})
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(primaryStarted)
		select {
		case <-r.Context().Done():
			close(primaryCancelled)
		case <-time.After(5 * time.Second):
			sseUpstream(chunkB, done)(w, r)
		}
	})
	var cancelledMidStream atomic.Bool
	fast := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(chunkA)(w, r)
		// The stream goes on only once the primary is cancelled: the
		// loser must be cancelled at the commit, not at the stream's end.
		select {
		case <-primaryCancelled:
			cancelledMidStream.Store(true)
		case <-time.After(5 * time.Second):
		}
		sseUpstream(chunkEnd, done)(w, r)
	})
	clk := clocktest.New(time.Time{})
	h := &fakeHedging{delay: 50 * time.Millisecond, allow: true}
	p, obs := hedgedProxy(t, Config{Clock: clk, Hedging: h, Retries: &fakeRetries{allow: true}}, slow, fast)
	w := httptest.NewRecorder()
	served := serve(p, w, post(`{"stream":true}`))
	await(t, primaryStarted, "primary started")
	clk.WaitTimer(t, h.delay)
	clk.Advance(h.delay)
	res := result(t, served)
	if w.Body.String() != chunkA+chunkEnd+done || res.Upstream != fast.addr() || !res.Hedged {
		t.Fatalf("body %q upstream %s hedged %v", w.Body, res.Upstream, res.Hedged)
	}
	if !cancelledMidStream.Load() {
		t.Fatal("the primary was not cancelled while the winner streamed")
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 2 })
	if got := strings.Join(obs.outcomes(), " "); !strings.Contains(got, slow.addr()+"=canceled") {
		t.Fatalf("the loser must be neutral (canceled): %s", got)
	}
	if obs.hedges[HedgeFired] != 1 || obs.hedges[HedgeWon] != 1 || h.observed.Load() != 1 {
		t.Fatalf("hedges %v observed %d", obs.hedges, h.observed.Load())
	}
}

func TestHedgeCapRefusalLeavesPrimaryToFinish(t *testing.T) {
	release := make(chan struct{})
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		await(t, release, "release")
		sseUpstream(chunkA, done)(w, r)
	})
	other := newUpstream(t, sseUpstream(chunkB, done))
	clk := clocktest.New(time.Time{})
	p, obs := hedgedProxy(t, Config{Clock: clk, Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: false}}, slow, other)
	served := serve(p, httptest.NewRecorder(), post(`{"stream":true}`))
	clk.WaitTimer(t, 20*time.Millisecond)
	clk.Advance(20 * time.Millisecond)
	obs.waitFor(t, func() bool { return obs.hedges[HedgeSuppressed] == 1 })
	close(release)
	res := result(t, served)
	if res.Outcome != OutcomeSuccess || res.Upstream != slow.addr() || res.Hedged || other.calls.Load() != 0 {
		t.Fatalf("result %+v, other calls %d", res, other.calls.Load())
	}
}

func TestPrimaryFailingFastStartsBackupAtOnce(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) })
	good := newUpstream(t, sseUpstream(chunkA, done))
	p, _ := hedgedProxy(t, Config{
		Clock:   clocktest.New(time.Time{}), // never advanced: a backoff or a hedge delay would wait forever
		Hedging: &fakeHedging{delay: 10 * time.Second, allow: true},
		Retries: &fakeRetries{allow: true, backoff: time.Second},
	}, bad, good)
	res := result(t, serve(p, httptest.NewRecorder(), post(`{"stream":true}`)))
	if res.Outcome != OutcomeSuccess || res.Upstream != good.addr() {
		t.Fatalf("result %+v", res)
	}
}

func TestRetryBackoffAndBudget(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) }
	t.Run("budget refuses: one call, failure at once", func(t *testing.T) {
		a, b := newUpstream(t, h), newUpstream(t, h)
		p, obs := hedgedProxy(t, Config{Clock: clocktest.New(time.Time{}), Retries: &fakeRetries{allow: false}}, a, b)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(`{}`))
		if w.Code != 503 || res.Attempts != 1 || a.calls.Load()+b.calls.Load() != 1 || obs.exhausted != 1 {
			t.Fatalf("code %d attempts %d exhausted %d", w.Code, res.Attempts, obs.exhausted)
		}
	})
	t.Run("budget grants: backoff, then another upstream", func(t *testing.T) {
		a, b := newUpstream(t, h), newUpstream(t, sseUpstream(chunkA, done))
		clk := clocktest.New(time.Time{})
		r := &fakeRetries{allow: true, backoff: 150 * time.Millisecond}
		p, obs := hedgedProxy(t, Config{Clock: clk, Retries: r}, a, b)
		served := serve(p, httptest.NewRecorder(), post(`{"stream":true}`))
		clk.WaitTimer(t, r.backoff)
		if b.calls.Load() != 0 {
			t.Fatal("retried before the backoff passed")
		}
		clk.Advance(r.backoff)
		res := result(t, served)
		if res.Outcome != OutcomeSuccess || res.Retries != 1 || obs.retries != 1 || r.granted.Load() != 1 || b.calls.Load() != 1 {
			t.Fatalf("result %+v retries observed %d", res, obs.retries)
		}
	})
}

func TestClientErrorDuringHedgeIsAnsweredAtOnce(t *testing.T) {
	answer := make(chan struct{})
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		await(t, answer, "answer")
		http.Error(w, `{"error":{"message":"context too long"}}`, 400)
	})
	backupStarted, backupCancelled := make(chan struct{}), make(chan struct{})
	backup := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		close(backupStarted)
		select {
		case <-r.Context().Done():
			close(backupCancelled)
		case <-time.After(5 * time.Second):
			http.Error(w, `{"error":{"message":"context too long"}}`, 400)
		}
	})
	clk := clocktest.New(time.Time{})
	p, _ := hedgedProxy(t, Config{Clock: clk, Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: true}}, primary, backup)
	w := httptest.NewRecorder()
	served := serve(p, w, post(`{"stream":true}`))
	clk.WaitTimer(t, 20*time.Millisecond)
	clk.Advance(20 * time.Millisecond)
	await(t, backupStarted, "backup started")
	close(answer)
	res := result(t, served)
	if w.Code != 400 || res.Outcome != OutcomeClientError {
		t.Fatalf("code %d outcome %v", w.Code, res.Outcome)
	}
	// Had the proxy waited for the backup, the backup would have answered
	// after 5s instead of being cancelled.
	await(t, backupCancelled, "the backup cancelled")
}

// pickLog is a balancer for hedge timing tests: primaries go to primary
// (untried ones first when it lists several), backups to backup; it
// records the clock at each pick and signals backup picks.
type pickLog struct {
	clk      *clocktest.Fake
	primary  []string
	backup   string
	mu       sync.Mutex
	primPick []time.Time
	hedgeAt  chan time.Time
}

func (b *pickLog) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	now := b.clk.Now()
	if req.Hedge {
		b.hedgeAt <- now
		return Upstream{Addr: b.backup, Closed: true}, nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.primPick = append(b.primPick, now)
	return Upstream{Addr: b.primary[min(len(b.primPick), len(b.primary))-1], Closed: true}, nil
}

func (b *pickLog) lastPrimary() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.primPick[len(b.primPick)-1]
}

// hedgePick waits for the backup's pick and returns the clock then.
func (b *pickLog) hedgePick(t *testing.T) time.Time {
	t.Helper()
	select {
	case at := <-b.hedgeAt:
		return at
	case <-time.After(5 * time.Second):
		t.Fatal("no backup picked within 5s")
		return time.Time{}
	}
}

func hangUntilCancelled(started chan<- struct{}) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		started <- struct{}{}
		select {
		case <-r.Context().Done():
		case <-time.After(5 * time.Second):
		}
	}
}

// Each primary gets its own hedge delay, counted from its own start. The
// old bug: the hedge timer was armed once per request, so a replacement
// primary started by a retry inherited what was left of the first one's
// delay and was hedged too early.
func TestReplacementPrimaryGetsItsOwnHedgeDelay(t *testing.T) {
	const delay = 100 * time.Millisecond
	failA := make(chan struct{})
	a := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		await(t, failA, "fail A")
		http.Error(w, "down", 503)
	})
	bStarted := make(chan struct{}, 1)
	b := newUpstream(t, hangUntilCancelled(bStarted))
	c := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := clocktest.New(time.Time{})
	bal := &pickLog{clk: clk, primary: []string{a.addr(), b.addr()}, backup: c.addr(), hedgeAt: make(chan time.Time, 1)}
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal, Clock: clk, MaxAttempts: 3,
		Hedging: &fakeHedging{delay: delay, allow: true}, Retries: &fakeRetries{allow: true}})
	if err != nil {
		t.Fatal(err)
	}
	served := serve(p, httptest.NewRecorder(), post(`{"stream":true}`))
	clk.WaitTimer(t, delay)
	clk.Advance(80 * time.Millisecond)
	close(failA) // A fails at 80ms and is replaced at once by B
	select {
	case <-bStarted:
	case <-time.After(5 * time.Second):
		t.Fatal("B never started")
	}
	var hedgedAt time.Time
	if clk.Advance(20*time.Millisecond) > 0 {
		hedgedAt = bal.hedgePick(t) // the first primary's delay ran out
	} else {
		clk.Advance(delay - 20*time.Millisecond)
		hedgedAt = bal.hedgePick(t)
	}
	if got := hedgedAt.Sub(bal.lastPrimary()); got != delay {
		t.Fatalf("backup started %v after the replacement primary, want its own delay %v", got, delay)
	}
	if res := result(t, served); res.Outcome != OutcomeSuccess || res.Upstream != c.addr() {
		t.Fatalf("result %+v", res)
	}
}

// The hedge delay runs only while a primary runs. The old bug: a delay that
// expired during a retry's backoff fired a backup right after the retry
// started.
func TestHedgeDelayDoesNotRunDuringBackoff(t *testing.T) {
	const delay = 100 * time.Millisecond
	var calls atomic.Int64
	aStarted := make(chan struct{}, 1)
	a := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1) == 1 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
			return
		}
		hangUntilCancelled(aStarted)(w, r)
	})
	c := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	clk := clocktest.New(time.Time{})
	bal := &pickLog{clk: clk, primary: []string{a.addr()}, backup: c.addr(), hedgeAt: make(chan time.Time, 1)}
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: bal, Clock: clk, MaxAttempts: 3,
		Hedging: &fakeHedging{delay: delay, allow: true}, Retries: &fakeRetries{allow: true}})
	if err != nil {
		t.Fatal(err)
	}
	served := serve(p, httptest.NewRecorder(), post(`{"stream":true}`))
	clk.WaitTimer(t, time.Second) // backing off for A's Retry-After
	fired := clk.Advance(time.Second)
	select {
	case <-aStarted:
	case <-time.After(5 * time.Second):
		t.Fatal("the retry never started")
	}
	var hedgedAt time.Time
	if fired > 1 {
		hedgedAt = bal.hedgePick(t) // the hedge timer ran during the backoff
	} else {
		clk.Advance(delay)
		hedgedAt = bal.hedgePick(t)
	}
	if got := hedgedAt.Sub(bal.lastPrimary()); got != delay {
		t.Fatalf("backup started %v after the retried primary, want %v", got, delay)
	}
	if res := result(t, served); res.Outcome != OutcomeSuccess || res.Upstream != c.addr() {
		t.Fatalf("result %+v", res)
	}
}

// slowBackupBalancer marks upstreams closed and gives backups a Context
// hook that takes its time (Caddy's adds dial information there) and
// signals their pick.
type slowBackupBalancer struct {
	closedBalancer
	hedgePicked chan struct{}
}

func (b slowBackupBalancer) Pick(w http.ResponseWriter, r *http.Request, req PickRequest) (Upstream, error) {
	up, err := b.closedBalancer.Pick(w, r, req)
	if req.Hedge && err == nil {
		close(b.hedgePicked)
		up.Context = func(ctx context.Context) context.Context {
			time.Sleep(200 * time.Millisecond) // no synchronisation with the request's goroutine
			return ctx
		}
	}
	return up, err
}

// A backup may build its outbound request after the primary committed
// (it reads the client's request, body and outbound header then): commit
// must not let go of them under it. Under the race detector only.
func TestHedgeLoserBuildsItsRequestAfterCommit(t *testing.T) {
	answer := make(chan struct{})
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		await(t, answer, "answer")
		sseUpstream(chunkA, chunkEnd, done)(w, r)
	})
	backup := newUpstream(t, sseUpstream(chunkA, chunkEnd, done))
	lb := &listBalancer{addrs: []string{primary.addr(), backup.addr()}}
	b := slowBackupBalancer{closedBalancer{lb}, make(chan struct{})}
	obs := &recordingObserver{}
	clk := clocktest.New(time.Time{})
	p, err := New(Config{Transport: schemeTransport{http.DefaultTransport}, Balancer: b, Observer: obs, Clock: clk,
		MaxAttempts: 3, Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: true}})
	if err != nil {
		t.Fatal(err)
	}
	served := serve(p, httptest.NewRecorder(), post(`{"model":"m","stream":true}`))
	clk.WaitTimer(t, 20*time.Millisecond)
	clk.Advance(20 * time.Millisecond)
	await(t, b.hedgePicked, "backup picked")
	close(answer)
	if res := result(t, served); res.Outcome != OutcomeSuccess || res.Upstream != primary.addr() {
		t.Fatalf("outcome %v upstream %s", res.Outcome, res.Upstream)
	}
	obs.waitFor(t, func() bool { return len(obs.attempts) == 2 }) // the backup has built its request and ended
}
