package mockllm

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestChatStreamHasVLLMShape(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	body := `{"model":"m1","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`
	resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, content-type %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if got := resp.Header.Get(HeaderReplica); got != f.Addrs()[0] {
		t.Errorf("%s = %q, want %q", HeaderReplica, got, f.Addrs()[0])
	}
	s := readSSE(resp.Body)
	if s.err != nil {
		t.Fatalf("stream: %v", s.err)
	}
	// role, 5 tokens, usage, [DONE]
	if len(s.data) != 8 {
		t.Fatalf("got %d events, want 8: %q", len(s.data), s.data)
	}
	if want := `"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`; !strings.HasSuffix(s.data[0], want) {
		t.Errorf("role chunk %s", s.data[0])
	}
	var id string
	var text strings.Builder
	for i, d := range s.data[:6] {
		m := chunkOf(t, d)
		if m["object"] != "chat.completion.chunk" || m["model"] != "m1" || !strings.HasPrefix(m["id"].(string), "chatcmpl-") {
			t.Errorf("event %d: %s", i, d)
		}
		if id == "" {
			id = m["id"].(string)
		} else if m["id"] != id {
			t.Errorf("event %d: id %v, want %s", i, m["id"], id)
		}
		ch := choice0(t, m)
		if i == 0 {
			continue
		}
		text.WriteString(ch["delta"].(map[string]any)["content"].(string))
		wantFinish := any(nil)
		if i == 5 {
			wantFinish = "stop"
		}
		if ch["finish_reason"] != wantFinish {
			t.Errorf("event %d: finish_reason %v, want %v", i, ch["finish_reason"], wantFinish)
		}
	}
	if !strings.Contains(s.data[6], `"choices":[],"usage":{"prompt_tokens":`) {
		t.Errorf("usage chunk %s", s.data[6])
	}
	u := chunkOf(t, s.data[6])["usage"].(map[string]any)
	if u["completion_tokens"] != 5.0 || u["total_tokens"] != u["prompt_tokens"].(float64)+5 {
		t.Errorf("usage %v", u)
	}
	if s.data[7] != "[DONE]" {
		t.Errorf("last event %q", s.data[7])
	}
	if utf8.RuneCountInString(text.String()) == len(text.String()) {
		t.Errorf("content %q has no multi-byte characters", text.String())
	}

	// The same prompt gets the same text, streamed or not.
	nb := `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`
	resp2, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", nb)
	if err != nil {
		t.Fatal(err)
	}
	var full completion
	if err := json.NewDecoder(resp2.Body).Decode(&full); err != nil {
		t.Fatal(err)
	}
	resp2.Body.Close()
	if got := full.Choices[0].Message.Content; got != text.String() {
		t.Errorf("non-streamed text %q, want %q", got, text.String())
	}
}

func TestChatStreamWithoutUsageOption(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s := readSSE(resp.Body)
	if len(s.data) != 7 || s.data[6] != "[DONE]" || strings.Contains(strings.Join(s.data, ""), `"usage"`) {
		t.Fatalf("events %q", s.data)
	}
}

func TestMaxTokensFinishesWithLength(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	for _, field := range []string{"max_tokens", "max_completion_tokens"} {
		body := `{"model":"m1","messages":[],"stream":true,"` + field + `":3}`
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", body)
		if err != nil {
			t.Fatal(err)
		}
		s := readSSE(resp.Body)
		resp.Body.Close()
		if n := contentEvents(t, s); n != 3 {
			t.Errorf("%s: %d content events, want 3", field, n)
		}
		if fr := choice0(t, chunkOf(t, s.data[3]))["finish_reason"]; fr != "length" {
			t.Errorf("%s: finish_reason %v, want length", field, fr)
		}
	}
}

func TestTextCompletionStream(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	body := `{"model":"m1","prompt":"once upon","stream":true,"stream_options":{"include_usage":true}}`
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s := readSSE(resp.Body)
	// 5 tokens (no role chunk), usage, [DONE]
	if len(s.data) != 7 {
		t.Fatalf("events %q", s.data)
	}
	for i, d := range s.data[:5] {
		m := chunkOf(t, d)
		ch := choice0(t, m)
		if m["object"] != "text_completion" || !strings.HasPrefix(m["id"].(string), "cmpl-") {
			t.Errorf("event %d: %s", i, d)
		}
		if _, ok := ch["text"].(string); !ok {
			t.Errorf("event %d: no text: %s", i, d)
		}
	}
	if choice0(t, chunkOf(t, s.data[4]))["finish_reason"] != "stop" {
		t.Errorf("last token chunk %s", s.data[4])
	}
	if s.data[6] != "[DONE]" {
		t.Errorf("events %q", s.data)
	}
}

func TestNonStreamingResponses(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	for _, tc := range []struct{ path, body, object string }{
		{"/v1/chat/completions", `{"model":"m1","messages":[{"role":"user","content":"hi"}]}`, "chat.completion"},
		{"/v1/completions", `{"model":"m1","prompt":"hi","max_tokens":2}`, "text_completion"},
	} {
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+tc.path, tc.body)
		if err != nil {
			t.Fatal(err)
		}
		var got struct {
			ID      string `json:"id"`
			Object  string `json:"object"`
			Choices []struct {
				Message *struct {
					Role, Content string
				} `json:"message"`
				Text         *string `json:"text"`
				FinishReason string  `json:"finish_reason"`
			} `json:"choices"`
			Usage struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				TotalTokens      int `json:"total_tokens"`
			} `json:"usage"`
		}
		if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
			t.Fatalf("%s: %v", tc.path, err)
		}
		resp.Body.Close()
		if got.Object != tc.object || len(got.Choices) != 1 || got.Usage.TotalTokens != got.Usage.PromptTokens+got.Usage.CompletionTokens {
			t.Errorf("%s: %+v", tc.path, got)
		}
		if tc.object == "chat.completion" && (got.Choices[0].Message == nil || got.Choices[0].Message.Content == "" || got.Choices[0].FinishReason != "stop" || got.Usage.CompletionTokens != 5) {
			t.Errorf("%s: %+v", tc.path, got)
		}
		if tc.object == "text_completion" && (got.Choices[0].Text == nil || got.Choices[0].FinishReason != "length" || got.Usage.CompletionTokens != 2) {
			t.Errorf("%s: %+v", tc.path, got)
		}
	}
}

func TestInvalidJSONIs400(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", `{"model":`)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got errorBody
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 400 || got.Error.Type != "BadRequestError" || got.Error.Code != 400 || got.Error.Message == "" {
		t.Fatalf("status %d, body %+v", resp.StatusCode, got)
	}
	if rec := lastRecord(t, f.Replica(0)); rec.Outcome != OutcomeInvalidRequest || rec.Status != 400 {
		t.Errorf("record %+v", rec)
	}
}

func TestBadMockHeaderIs400(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody, "X-Mock-TTFT: soon")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 400 {
		t.Fatalf("status %d, want 400", resp.StatusCode)
	}
}

func TestTokenBytesPadsContent(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/chat/completions", chatBody,
		"X-Mock-Tokens: 20", "X-Mock-Token-Bytes: 1000", "X-Mock-Token-Interval: 0")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	s := readSSE(resp.Body)
	total := 0
	for _, d := range s.data[1:21] {
		c := choice0(t, chunkOf(t, d))["delta"].(map[string]any)["content"].(string)
		if len(c) < 997 || len(c) > 1000 || !utf8.ValidString(c) {
			t.Fatalf("token of %d bytes", len(c))
		}
		total += len(c)
	}
	if total < 19_900 {
		t.Errorf("total content %d bytes", total)
	}
}

func TestRequestRecordKeepsBodyHashAndHeaders(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	bodies := []string{chatBody, strings.Replace(chatBody, "hi", "hello", 1)}
	for _, b := range bodies {
		resp, err := post(t, c, context.Background(), f.Replica(0).URL()+"/v1/chat/completions", b,
			"Authorization: Bearer secret", "X-Forwarded-For: 10.1.2.3", "X-Request-Id: req-1")
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp.Body)
		resp.Body.Close()
	}
	s := f.Replica(0).Stats()
	if len(s.BodySHA256) != 2 || s.BodySHA256[0] == s.BodySHA256[1] {
		t.Fatalf("body hashes %v", s.BodySHA256)
	}
	if s.BodySHA256[0] != sha256Hex(bodies[0]) || s.BodySHA256[1] != sha256Hex(bodies[1]) {
		t.Errorf("body hashes %v", s.BodySHA256)
	}
	rec := s.Recent[1]
	if rec.BodySHA256 != s.BodySHA256[1] || !rec.Authorization || rec.XForwardedFor != "10.1.2.3" ||
		rec.ID != "chatcmpl-req-1" || rec.Outcome != OutcomeCompleted || rec.EventsSent != 7 || rec.TokensSent != 5 ||
		rec.Model != "m1" || !rec.Stream || rec.Status != 200 || rec.Ended.Before(rec.FirstEvent) || rec.FirstEvent.Before(rec.Started) {
		t.Errorf("record %+v", rec)
	}
	if _, ok := rec.Headers["authorization"]; ok {
		t.Error("authorization value recorded")
	}
	if s.Requests != 2 || s.Completed != 2 || s.InFlight != 0 {
		t.Errorf("stats %+v", s)
	}
	raw, err := json.Marshal(f.Stats())
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{`"replicas":[`, `"body_sha256":[`, `"in_flight":0`, `"recent":[`, `"ended":"`, `"authorization":true`, `"x_forwarded_for":"10.1.2.3"`} {
		if !strings.Contains(string(raw), k) {
			t.Errorf("stats JSON lacks %s: %s", k, raw)
		}
	}
}

func TestMethodNotAllowed(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	resp, err := client(t).Get(f.Replica(0).URL() + "/v1/chat/completions")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusMethodNotAllowed || f.Replica(0).Stats().Requests != 0 {
		t.Fatalf("status %d", resp.StatusCode)
	}
}

func sha256Hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

// TestLastBodyAndUsageAreRecorded: the replica keeps the last request's
// body byte for byte and its headers, and records the usage it reported
// (in a stream's usage chunk when asked, in a JSON body), none for a
// stream that did not ask; a reset forgets the last body.
func TestLastBodyAndUsageAreRecorded(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	c := client(t)
	url := f.Replica(0).URL() + "/v1/chat/completions"
	bodies := []string{
		chatBody, // stream, no usage asked
		`{"model":"m1", "messages":[{"role":"user","content":"h\u00e9"}],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"model":"m1","messages":[{"role":"user","content":"plain"}]}`,
	}
	for i, b := range bodies {
		resp, err := post(t, c, context.Background(), url, b, "X-Tenant-Probe: t"+strconv.Itoa(i), "Authorization: Bearer secret")
		if err != nil {
			t.Fatal(err)
		}
		readAll(t, resp.Body)
		resp.Body.Close()
		s := f.Replica(0).Stats()
		if string(s.LastBody) != b {
			t.Errorf("request %d: LastBody %q, want %q", i, s.LastBody, b)
		}
		if got := s.LastHeaders["x-tenant-probe"]; got != "t"+strconv.Itoa(i) {
			t.Errorf("request %d: LastHeaders[x-tenant-probe] = %q", i, got)
		}
		if _, ok := s.LastHeaders["authorization"]; ok {
			t.Errorf("request %d: LastHeaders holds authorization", i)
		}
	}
	// A JSON body can be read in full before the replica records it.
	lastRecord(t, f.Replica(0))
	s := f.Replica(0).Stats()
	if s.Recent[0].Usage != nil {
		t.Errorf("a stream that did not ask for usage recorded usage %+v", *s.Recent[0].Usage)
	}
	for _, i := range []int{1, 2} {
		u := s.Recent[i].Usage
		if u == nil || u.CompletionTokens != 5 || u.PromptTokens < 1 || u.TotalTokens != u.PromptTokens+u.CompletionTokens {
			t.Errorf("request %d: usage %+v, want 5 completion tokens and a consistent total", i, u)
		}
	}
	f.ResetStats()
	if s := f.Replica(0).Stats(); s.LastBody != nil || s.LastHeaders != nil {
		t.Errorf("after a reset: LastBody %q, LastHeaders %v", s.LastBody, s.LastHeaders)
	}
}
