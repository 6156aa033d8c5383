package proxy

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// pickRecorder is a listBalancer that keeps every PickRequest it gets.
type pickRecorder struct {
	listBalancer
	mu   sync.Mutex
	reqs []PickRequest
}

func (b *pickRecorder) Pick(w http.ResponseWriter, r *http.Request, req PickRequest) (Upstream, error) {
	b.mu.Lock()
	b.reqs = append(b.reqs, req)
	b.mu.Unlock()
	return b.listBalancer.Pick(w, r, req)
}

// TestModelsWithoutAConvoy: 20 clients ask for GET /v1/models at once while
// the upstream takes its time; the first of them hangs up. The upstream is
// asked once, the 19 others get the list, the one that left returns at
// once, and the model list never asks for a half-open breaker's probe.
func TestModelsWithoutAConvoy(t *testing.T) {
	hold := make(chan struct{})
	var asked atomic.Int64
	arrived := make(chan struct{}, 4)
	slow := newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		asked.Add(1)
		arrived <- struct{}{}
		select {
		case <-hold:
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"llama-70b","object":"model"}]}`))
	})
	bal := &pickRecorder{listBalancer: listBalancer{addrs: []string{slow.addr()}}}
	m := &Models{Sources: []ModelSource{{Name: "primary", Balancer: bal}},
		Transport: schemeTransport{http.DefaultTransport}, Clock: clocktest.New(time.Time{})}

	type answer struct {
		code int
		body string
	}
	get := func(ctx context.Context, out chan<- answer) {
		w := httptest.NewRecorder()
		r := httptest.NewRequest("GET", "/v1/models", nil).WithContext(ctx)
		m.ServeHTTP(w, r, nil)
		out <- answer{w.Code, w.Body.String()}
	}
	// The first client starts the refresh, then hangs up while it runs.
	leaver, hangUp := context.WithCancel(context.Background())
	left := make(chan answer, 1)
	go get(leaver, left)
	<-arrived
	answers := make(chan answer, 19)
	for range 19 {
		go get(context.Background(), answers)
	}
	hangUp()
	select {
	case <-left:
	case <-time.After(5 * time.Second):
		t.Fatal("the client that hung up was kept waiting for the refresh")
	}
	close(hold)
	const want = `{"object":"list","data":[{"id":"llama-70b","object":"model","pools":["primary"]}]}` + "\n"
	for range 19 {
		select {
		case a := <-answers:
			if a.code != 200 || a.body != want {
				t.Fatalf("a waiting client got %d %s, want 200 and the list", a.code, a.body)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a waiting client got no answer")
		}
	}
	if n := asked.Load(); n != 1 {
		t.Fatalf("the upstream was asked %d times for 20 concurrent clients, want once", n)
	}
	bal.mu.Lock()
	defer bal.mu.Unlock()
	for _, req := range bal.reqs {
		if !req.Hedge {
			t.Fatalf("the model list picked with %+v: it may take a half-open breaker's probe slot (want closed breakers only)", req)
		}
	}
}
