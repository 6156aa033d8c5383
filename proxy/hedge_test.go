package proxy

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
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

func TestHedgeFirstEventWinsAndLoserIsCancelled(t *testing.T) {
	primaryCancelled := make(chan time.Time, 1)
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			primaryCancelled <- time.Now()
		case <-time.After(5 * time.Second):
			sseUpstream(chunkB, done)(w, r)
		}
	})
	fast := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		sseUpstream(chunkA)(w, r)
		time.Sleep(400 * time.Millisecond) // the stream goes on well after the commit
		sseUpstream(chunkEnd, done)(w, r)
	})
	h := &fakeHedging{delay: 50 * time.Millisecond, allow: true}
	p, obs := hedgedProxy(t, Config{Hedging: h, Retries: &fakeRetries{allow: true}}, slow, fast)
	w := &firstWrite{ResponseRecorder: httptest.NewRecorder()}
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	committed := w.at
	if w.Body.String() != chunkA+chunkEnd+done || res.Upstream != fast.addr() || !res.Hedged {
		t.Fatalf("body %q upstream %s hedged %v", w.Body, res.Upstream, res.Hedged)
	}
	select {
	case at := <-primaryCancelled:
		if lag := at.Sub(committed); lag > 50*time.Millisecond {
			t.Fatalf("primary cancelled %v after the commit", lag)
		}
	case <-time.After(time.Second):
		t.Fatal("primary never cancelled")
	}
	waitFor(t, func() bool { return len(obs.outcomes()) == 2 })
	if got := strings.Join(obs.outcomes(), " "); !strings.Contains(got, slow.addr()+"=canceled") {
		t.Fatalf("the loser must be neutral (canceled): %s", got)
	}
	if obs.hedges[HedgeFired] != 1 || obs.hedges[HedgeWon] != 1 || h.observed.Load() != 1 {
		t.Fatalf("hedges %v observed %d", obs.hedges, h.observed.Load())
	}
}

func TestHedgeCapRefusalLeavesPrimaryToFinish(t *testing.T) {
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(200 * time.Millisecond)
		sseUpstream(chunkA, done)(w, r)
	})
	other := newUpstream(t, sseUpstream(chunkB, done))
	p, obs := hedgedProxy(t, Config{Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: false}}, slow, other)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if res.Outcome != OutcomeSuccess || res.Upstream != slow.addr() || res.Hedged || other.calls.Load() != 0 {
		t.Fatalf("result %+v, other calls %d", res, other.calls.Load())
	}
	if obs.hedges[HedgeSuppressed] != 1 {
		t.Fatalf("hedges %v", obs.hedges)
	}
}

func TestPrimaryFailingFastStartsBackupAtOnce(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) })
	good := newUpstream(t, sseUpstream(chunkA, done))
	p, _ := hedgedProxy(t, Config{
		Hedging: &fakeHedging{delay: 10 * time.Second, allow: true},
		Retries: &fakeRetries{allow: true, backoff: time.Second},
	}, bad, good)
	start := time.Now()
	res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
	if res.Outcome != OutcomeSuccess || res.Upstream != good.addr() {
		t.Fatalf("result %+v", res)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("the backup waited %v: with hedging on, a fast failure fails over at once", d)
	}
}

func TestRetryBackoffAndBudget(t *testing.T) {
	h := func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) }
	t.Run("budget refuses: one call, failure at once", func(t *testing.T) {
		a, b := newUpstream(t, h), newUpstream(t, h)
		p, obs := hedgedProxy(t, Config{Retries: &fakeRetries{allow: false}}, a, b)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(`{}`))
		if w.Code != 503 || res.Attempts != 1 || a.calls.Load()+b.calls.Load() != 1 || obs.exhausted != 1 {
			t.Fatalf("code %d attempts %d exhausted %d", w.Code, res.Attempts, obs.exhausted)
		}
	})
	t.Run("budget grants: backoff, then another upstream", func(t *testing.T) {
		a, b := newUpstream(t, h), newUpstream(t, sseUpstream(chunkA, done))
		r := &fakeRetries{allow: true, backoff: 150 * time.Millisecond}
		p, obs := hedgedProxy(t, Config{Retries: r}, a, b)
		start := time.Now()
		res := p.ServeHTTP(httptest.NewRecorder(), post(`{"stream":true}`))
		if res.Outcome != OutcomeSuccess || res.Retries != 1 || obs.retries != 1 || r.granted.Load() != 1 {
			t.Fatalf("result %+v retries observed %d", res, obs.retries)
		}
		if d := time.Since(start); d < 150*time.Millisecond {
			t.Fatalf("retried after %v, before the 150ms backoff", d)
		}
	})
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 2s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// firstWrite records when the first byte reached the client (the commit).
type firstWrite struct {
	*httptest.ResponseRecorder
	at time.Time
}

func (w *firstWrite) Write(b []byte) (int, error) {
	if w.at.IsZero() {
		w.at = time.Now()
	}
	return w.ResponseRecorder.Write(b)
}

func TestClientErrorDuringHedgeIsAnsweredAtOnce(t *testing.T) {
	primary := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(100 * time.Millisecond)
		http.Error(w, `{"error":{"message":"context too long"}}`, 400)
	})
	backupCancelled := make(chan struct{})
	backup := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
			close(backupCancelled)
		case <-time.After(2 * time.Second):
			http.Error(w, `{"error":{"message":"context too long"}}`, 400)
		}
	})
	p, _ := hedgedProxy(t, Config{Hedging: &fakeHedging{delay: 20 * time.Millisecond, allow: true}}, primary, backup)
	start := time.Now()
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if w.Code != 400 || res.Outcome != OutcomeClientError || time.Since(start) > time.Second {
		t.Fatalf("code %d outcome %v after %v: a 4xx must not wait for the backup", w.Code, res.Outcome, time.Since(start))
	}
	select {
	case <-backupCancelled:
	case <-time.After(time.Second):
		t.Fatal("the backup was not cancelled")
	}
}
