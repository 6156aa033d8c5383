package proxy

import (
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

func modelsUpstream(t *testing.T, ids ...string) *upstream {
	return newUpstream(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" || r.Header.Get("Authorization") != "" {
			http.Error(w, "wrong request", 400)
			return
		}
		body := `{"object":"list","data":[`
		for i, id := range ids {
			if i > 0 {
				body += ","
			}
			body += `{"id":"` + id + `","object":"model","owned_by":"vllm","max_model_len":8192}`
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(body + "]}"))
	})
}

func TestModelsListsTheUnionOfThePools(t *testing.T) {
	big := modelsUpstream(t, "llama-70b", "shared")
	small := modelsUpstream(t, "llama-8b", "shared")
	down := newUpstream(t, failing(503))
	clk := clocktest.New(time.Time{})
	m := &Models{
		Sources: []ModelSource{
			{Name: "primary", Balancer: &listBalancer{addrs: []string{down.addr(), big.addr()}}},
			{Name: "small", Balancer: &listBalancer{addrs: []string{small.addr()}}},
		},
		Transport: schemeTransport{http.DefaultTransport}, Clock: clk,
	}
	get := func() *httptest.ResponseRecorder {
		w := httptest.NewRecorder()
		r := httptest.NewRequest("GET", "/v1/models", nil)
		r.Header.Set("Authorization", "Bearer sk-secret")
		if !IsModelsRequest(r) {
			t.Fatal("GET /v1/models not recognised")
		}
		m.ServeHTTP(w, r, nil)
		return w
	}
	w := get()
	want := `{"object":"list","data":[` +
		`{"id":"llama-70b","object":"model","owned_by":"vllm","max_model_len":8192,"pools":["primary"]},` +
		`{"id":"shared","object":"model","owned_by":"vllm","max_model_len":8192,"pools":["primary","small"]},` +
		`{"id":"llama-8b","object":"model","owned_by":"vllm","max_model_len":8192,"pools":["small"]}]}` + "\n"
	if w.Code != 200 || w.Body.String() != want {
		t.Fatalf("status %d body\n%s\nwant\n%s", w.Code, w.Body, want)
	}
	if down.calls.Load() != 1 || big.calls.Load() != 1 {
		t.Fatalf("the failing upstream is tried once, then the next: calls %d/%d", down.calls.Load(), big.calls.Load())
	}
	get()
	if small.calls.Load() != 1 {
		t.Fatalf("within the TTL the list is cached: %d calls", small.calls.Load())
	}
	clk.Advance(DefaultModelsTTL)
	if w := get(); w.Body.String() != want || small.calls.Load() != 2 {
		t.Fatalf("after the TTL the pools are asked again: calls %d", small.calls.Load())
	}
	// Every pool down: the last list is served.
	small.Close()
	big.Close()
	clk.Advance(DefaultModelsTTL)
	if w := get(); w.Code != 200 || w.Body.String() != want {
		t.Fatalf("stale list not served: %d %s", w.Code, w.Body)
	}
}

func TestModelsWithoutAnyAnswerIs502(t *testing.T) {
	down := newUpstream(t, failing(500))
	m := &Models{Sources: []ModelSource{{Name: "primary", Balancer: &listBalancer{addrs: []string{down.addr()}}}},
		Transport: schemeTransport{http.DefaultTransport}, Timeout: time.Second}
	w := httptest.NewRecorder()
	m.ServeHTTP(w, httptest.NewRequest("GET", "/v1/models", nil), nil)
	if w.Code != 502 || errorBodyOf(t, w).Code != "upstream_error" {
		t.Fatalf("status %d body %s", w.Code, w.Body)
	}
	for _, r := range []*http.Request{httptest.NewRequest("POST", "/v1/models", nil), httptest.NewRequest("GET", "/v1/chat/completions", nil)} {
		if IsModelsRequest(r) {
			t.Fatalf("%s %s taken for a model list", r.Method, r.URL.Path)
		}
	}
}

func TestModelsAskForTheSameCredentials(t *testing.T) {
	big := modelsUpstream(t, "llama-70b")
	m := &Models{Sources: []ModelSource{{Name: "primary", Balancer: &listBalancer{addrs: []string{big.addr()}}}},
		Transport: schemeTransport{http.DefaultTransport}}
	deny := testIdentifier{err: &GatewayError{Status: 401, Type: TypeInvalidRequest, Code: "invalid_api_key", Message: "unknown key"}}
	w := httptest.NewRecorder()
	m.ServeHTTP(w, httptest.NewRequest("GET", "/v1/models", nil), deny)
	if w.Code != 401 || errorBodyOf(t, w).Code != "invalid_api_key" || big.calls.Load() != 0 {
		t.Fatalf("status %d body %s upstream calls %d", w.Code, w.Body, big.calls.Load())
	}
	w = httptest.NewRecorder()
	m.ServeHTTP(w, httptest.NewRequest("GET", "/v1/models", nil), testIdentifier{})
	if w.Code != 200 {
		t.Fatalf("an identified client: status %d", w.Code)
	}
}

// A pool that cannot be asked (every breaker open: the pick refuses) keeps
// its models in the list with its last answer; before, the merged list
// dropped them until its breakers closed, and SDKs saw the route vanish.
func TestModelsKeepAPoolThatCannotBeAsked(t *testing.T) {
	big := modelsUpstream(t, "llama-70b")
	small := modelsUpstream(t, "llama-8b")
	clk := clocktest.New(time.Time{})
	open := false
	smallPool := balancerFunc(func(req PickRequest) (Upstream, error) {
		if open {
			return Upstream{}, &UnavailableError{CircuitOpen: true, RetryAfter: 30 * time.Second, Reason: "open"}
		}
		return Upstream{Addr: small.addr()}, nil
	})
	m := &Models{
		Sources: []ModelSource{
			{Name: "primary", Balancer: &listBalancer{addrs: []string{big.addr()}}},
			{Name: "small", Balancer: smallPool},
		},
		Transport: schemeTransport{http.DefaultTransport}, Clock: clk,
	}
	get := func() string {
		w := httptest.NewRecorder()
		m.ServeHTTP(w, httptest.NewRequest("GET", "/v1/models", nil), nil)
		if w.Code != 200 {
			t.Fatalf("status %d", w.Code)
		}
		return w.Body.String()
	}
	want := `{"object":"list","data":[` +
		`{"id":"llama-70b","object":"model","owned_by":"vllm","max_model_len":8192,"pools":["primary"]},` +
		`{"id":"llama-8b","object":"model","owned_by":"vllm","max_model_len":8192,"pools":["small"]}]}` + "\n"
	if got := get(); got != want {
		t.Fatalf("body\n%s\nwant\n%s", got, want)
	}
	open = true
	clk.Advance(DefaultModelsTTL)
	if got := get(); got != want || big.calls.Load() != 2 {
		t.Fatalf("with the small pool's breakers open (primary asked %d times): body\n%s\nwant\n%s", big.calls.Load(), got, want)
	}
}

// TestModelsSharingACacheSurviveAReload: a reload's new handler over the
// same pools (sharing the old one's ModelCache) serves the cached list
// without asking the pools within TTL, and after the TTL a pool that cannot
// answer is still listed with the answer it gave the old handler.
func TestModelsSharingACacheSurviveAReload(t *testing.T) {
	big := modelsUpstream(t, "llama-70b")
	small := modelsUpstream(t, "llama-8b")
	clk := clocktest.New(time.Time{})
	srcs := []ModelSource{
		{Name: "primary", Balancer: &listBalancer{addrs: []string{big.addr()}}},
		{Name: "small", Balancer: &listBalancer{addrs: []string{small.addr()}}},
	}
	cache := new(ModelCache)
	handler := func() *Models {
		return &Models{Sources: srcs, Transport: schemeTransport{http.DefaultTransport}, Clock: clk, Cache: cache}
	}
	get := func(m *Models) string {
		w := httptest.NewRecorder()
		m.ServeHTTP(w, httptest.NewRequest("GET", "/v1/models", nil), nil)
		if w.Code != 200 {
			t.Fatalf("status %d body %s", w.Code, w.Body)
		}
		return w.Body.String()
	}
	want := get(handler())
	reloaded := handler()
	if got := get(reloaded); got != want || big.calls.Load() != 1 || small.calls.Load() != 1 {
		t.Fatalf("after a reload within the TTL: calls %d/%d, body %s", big.calls.Load(), small.calls.Load(), got)
	}
	small.Close()
	clk.Advance(DefaultModelsTTL)
	if got := get(reloaded); got != want {
		t.Fatalf("a pool that cannot answer after the reload lost its models:\n%s\nwant\n%s", got, want)
	}
	if big.calls.Load() != 2 {
		t.Fatalf("after the TTL the answering pool is asked again: %d calls", big.calls.Load())
	}
}
