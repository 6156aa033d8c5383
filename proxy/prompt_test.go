package proxy

import (
	"bytes"
	"net/http"
	"slices"
	"sync"
	"testing"
)

// promptBalancer records the prompt each pick was given.
type promptBalancer struct {
	mu   sync.Mutex
	seen [][]string
}

func (b *promptBalancer) Pick(_ http.ResponseWriter, _ *http.Request, req PickRequest) (Upstream, error) {
	var segs []string
	if req.Prompt != nil {
		req.Prompt(func(s string) bool { segs = append(segs, s); return true })
	}
	b.mu.Lock()
	b.seen = append(b.seen, segs)
	b.mu.Unlock()
	return Upstream{Addr: "mem:1"}, nil
}

// TestPickGetsThePromptOfEveryAPI: lb_policy prefix_cache routes every
// API by its prompt, read through the request's API.
func TestPickGetsThePromptOfEveryAPI(t *testing.T) {
	for _, tc := range []struct {
		path, body string
		want       []string
	}{
		{"/v1/chat/completions", `{"model":"m","messages":[{"role":"system","content":"sys"},{"role":"user","content":"hi"}]}`, []string{"sys", "hi"}},
		{"/v1/completions", `{"model":"m","prompt":"once upon"}`, []string{"once upon"}},
		{"/v1/responses", `{"model":"m","instructions":"ins","input":[{"role":"user","content":"q"}]}`, []string{"ins", "q"}},
		{"/v1/messages", `{"model":"m","max_tokens":5,"system":"sys","messages":[{"role":"user","content":"q"}]}`, []string{"sys", "q"}},
		{"/v1/embeddings", `{"model":"m","input":"not routed by prompt"}`, nil},
	} {
		t.Run(tc.path, func(t *testing.T) {
			b := &promptBalancer{}
			p, err := New(Config{Transport: memTransport{[]byte(chunkA + chunkEnd + done)}, Balancer: b})
			if err != nil {
				t.Fatal(err)
			}
			r, _ := http.NewRequest(http.MethodPost, "http://gw"+tc.path, bytes.NewReader([]byte(tc.body)))
			r.Header.Set("Content-Type", "application/json")
			p.ServeHTTP(&discardWriter{h: http.Header{}}, r)
			if len(b.seen) == 0 {
				t.Fatal("no pick")
			}
			if got := b.seen[0]; !slices.Equal(got, tc.want) {
				t.Fatalf("the pick's prompt = %q, want %q", got, tc.want)
			}
		})
	}
}
