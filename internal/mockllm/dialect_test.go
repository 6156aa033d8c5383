package mockllm

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// namedEvent is one SSE event with its event: name (empty when none).
type namedEvent struct {
	name string
	data string
	at   time.Time // when the event's last line was read
}

// readNamed parses a stream into named events; err is io.ErrUnexpectedEOF
// when it ends inside an event.
func readNamed(r io.Reader) (evs []namedEvent, err error) {
	br := bufio.NewReader(r)
	var cur namedEvent
	var data []string
	for {
		line, rerr := br.ReadString('\n')
		if rerr != nil {
			if !errors.Is(rerr, io.EOF) {
				return evs, rerr
			}
			if line != "" || data != nil || cur.name != "" {
				return evs, io.ErrUnexpectedEOF
			}
			return evs, nil
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "":
			if data != nil || cur.name != "" {
				cur.data, cur.at = strings.Join(data, "\n"), time.Now()
				evs = append(evs, cur)
			}
			cur, data = namedEvent{}, nil
		case strings.HasPrefix(line, ":"):
		case strings.HasPrefix(line, "event: "):
			cur.name = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			data = append(data, strings.TrimPrefix(line, "data: "))
		}
	}
}

// streamAPI posts body to the API's path on replica 0 and reads the
// named events.
func streamAPI(t *testing.T, f *Fleet, a API, body string, headers ...string) (*http.Response, []namedEvent, error) {
	t.Helper()
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+a.Path(), body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	evs, err := readNamed(resp.Body)
	return resp, evs, err
}

// typed decodes an event's data and checks that its "type" repeats the
// event name, as both APIs' SDKs expect.
func typed(t *testing.T, e namedEvent) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(e.data), &m); err != nil {
		t.Fatalf("event %q: data %q is not JSON: %v", e.name, e.data, err)
	}
	if m["type"] != e.name {
		t.Errorf("event %q carries type %v", e.name, m["type"])
	}
	return m
}

// responsesAccumulator applies events as the openai SDK's
// ResponseAccumulator does, failing where it would throw: the first event
// must be response.created; deltas must name an existing output item and
// output_text part.
type responsesAccumulator struct {
	t        *testing.T
	snapshot map[string]any
	text     string // output_text accumulated from deltas
	seq      float64
	terminal string // response.completed, .incomplete, .failed or error
	usage    map[string]any
}

func (a *responsesAccumulator) add(e namedEvent) {
	t := a.t
	t.Helper()
	m := typed(t, e)
	seq, ok := m["sequence_number"].(float64)
	if !ok || seq != a.seq {
		t.Errorf("event %q: sequence_number %v, want %v", e.name, m["sequence_number"], a.seq)
	}
	a.seq++
	if a.terminal != "" {
		t.Errorf("event %q after the terminal %s", e.name, a.terminal)
	}
	if a.snapshot == nil {
		if e.name != "response.created" {
			t.Fatalf("first event %q, want response.created (the SDK throws otherwise)", e.name)
		}
		a.snapshot = m["response"].(map[string]any)
		for _, k := range []string{"id", "created_at", "model"} {
			if a.snapshot[k] == nil {
				t.Errorf("response.created without response.%s (the AI SDK's schema requires it)", k)
			}
		}
		return
	}
	output := func() []any { o, _ := a.snapshot["output"].([]any); return o }
	switch e.name {
	case "response.in_progress":
	case "response.output_item.added":
		a.snapshot["output"] = append(output(), m["item"])
	case "response.content_part.added":
		i := int(m["output_index"].(float64))
		if i >= len(output()) {
			t.Fatalf("content_part.added for missing output %d", i)
		}
		item := output()[i].(map[string]any)
		item["content"] = append(item["content"].([]any), m["part"])
	case "response.output_text.delta":
		i, j := int(m["output_index"].(float64)), int(m["content_index"].(float64))
		if i >= len(output()) {
			t.Fatalf("missing output at index %d", i)
		}
		content := output()[i].(map[string]any)["content"].([]any)
		if j >= len(content) || content[j].(map[string]any)["type"] != "output_text" {
			t.Fatalf("missing output_text content at index %d", j)
		}
		if _, ok := m["item_id"].(string); !ok {
			t.Errorf("delta without item_id: %s", e.data)
		}
		a.text += m["delta"].(string)
	case "response.output_text.done":
		if m["text"] != a.text {
			t.Errorf("output_text.done text %q, want the deltas' %q", m["text"], a.text)
		}
	case "response.content_part.done", "response.output_item.done":
	case "response.completed", "response.incomplete", "response.failed":
		a.terminal = e.name
		r := m["response"].(map[string]any)
		if want := strings.TrimPrefix(e.name, "response."); r["status"] != want {
			t.Errorf("%s with status %v", e.name, r["status"])
		}
		a.usage, _ = r["usage"].(map[string]any)
	case "error":
		a.terminal = e.name
		if _, ok := m["code"].(string); !ok {
			t.Errorf("error event without a string code: %s", e.data)
		}
		if _, ok := m["message"].(string); !ok {
			t.Errorf("error event without a message: %s", e.data)
		}
	default:
		t.Errorf("unexpected event %q", e.name)
	}
}

// messagesAccumulator applies events as the Anthropic SDK's MessageStream
// does, failing where it would throw.
type messagesAccumulator struct {
	t        *testing.T
	message  map[string]any
	text     string
	blocks   int
	stop     any // stop_reason of the last message_delta
	output   []float64
	stopped  bool
	errType  string
	pings    int
	deltasAt int // message_delta events seen
}

func (a *messagesAccumulator) add(e namedEvent) {
	t := a.t
	t.Helper()
	if e.name == "" {
		t.Errorf("event without an event: line (the Anthropic SDK skips it): %s", e.data)
		return
	}
	m := typed(t, e)
	if a.stopped || a.errType != "" {
		t.Errorf("event %q after the end", e.name)
	}
	if e.name == "ping" {
		a.pings++
		return
	}
	if e.name == "error" {
		er, _ := m["error"].(map[string]any)
		a.errType, _ = er["type"].(string)
		if _, ok := er["message"].(string); !ok || a.errType == "" {
			t.Errorf("error event without error.type and error.message: %s", e.data)
		}
		return
	}
	if a.message == nil {
		if e.name != "message_start" {
			t.Fatalf("first event %q, want message_start", e.name)
		}
		a.message = m["message"].(map[string]any)
		if a.message["role"] != "assistant" || a.message["type"] != "message" {
			t.Errorf("message_start message %v", a.message)
		}
		if u, ok := a.message["usage"].(map[string]any); !ok || u["input_tokens"] == nil {
			t.Errorf("message_start without usage.input_tokens: %s", e.data)
		}
		return
	}
	switch e.name {
	case "content_block_start":
		if int(m["index"].(float64)) != a.blocks {
			t.Errorf("content_block_start index %v, want %d", m["index"], a.blocks)
		}
		a.blocks++
	case "content_block_delta":
		if int(m["index"].(float64)) >= a.blocks {
			t.Fatalf("delta for content block %v that never started", m["index"])
		}
		d := m["delta"].(map[string]any)
		if d["type"] != "text_delta" {
			t.Errorf("delta type %v", d["type"])
		}
		a.text += d["text"].(string)
	case "content_block_stop":
	case "message_delta":
		a.deltasAt++
		a.stop = m["delta"].(map[string]any)["stop_reason"]
		a.output = append(a.output, m["usage"].(map[string]any)["output_tokens"].(float64))
	case "message_stop":
		a.stopped = true
	default:
		t.Errorf("unexpected event %q", e.name)
	}
}

// TestResponsesStreamParsesAsTheSDKsExpect: a Responses stream is named
// events with consecutive sequence_numbers that the openai SDK's
// accumulator takes without throwing; response.created and
// response.in_progress come at once, before the TTFT; the deltas add up
// to the non-streamed text; response.completed carries usage
// {input_tokens, output_tokens, total_tokens}.
func TestResponsesStreamParsesAsTheSDKsExpect(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: Behavior{TTFT: Fixed(150 * time.Millisecond), Tokens: 6, TokenInterval: NoDelay}})
	body := `{"model":"m1","instructions":"be brief","input":[{"role":"user","content":"hi"}],"stream":true}`
	start := time.Now()
	resp, evs, err := streamAPI(t, f, APIResponses, body, "X-Request-Id: r1")
	if err != nil || resp.StatusCode != 200 || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		t.Fatalf("status %d, %q, %v", resp.StatusCode, resp.Header.Get("Content-Type"), err)
	}
	a := &responsesAccumulator{t: t}
	var names []string
	for _, e := range evs {
		a.add(e)
		names = append(names, e.name)
	}
	want := "response.created response.in_progress response.output_item.added response.content_part.added" +
		strings.Repeat(" response.output_text.delta", 6) +
		" response.output_text.done response.content_part.done response.output_item.done response.completed"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("events:\n%s\nwant\n%s", got, want)
	}
	if d := evs[1].at.Sub(start); d > 100*time.Millisecond {
		t.Errorf("response.in_progress came %v after the request; lifecycle events come at once, before the 150ms TTFT", d)
	}
	if d := evs[4].at.Sub(start); d < 150*time.Millisecond {
		t.Errorf("the first delta came %v after the request, before the TTFT", d)
	}
	if a.snapshot["id"] != "resp_r1" {
		t.Errorf("response id %v, want resp_r1 (from X-Request-Id)", a.snapshot["id"])
	}
	if a.usage["output_tokens"] != 6.0 || a.usage["input_tokens"] == nil ||
		a.usage["total_tokens"] != a.usage["input_tokens"].(float64)+6 {
		t.Errorf("usage %v, want output_tokens 6 and total = input + output", a.usage)
	}
	rec := lastRecord(t, f.Replica(0))
	if rec.API != APIResponses || rec.Usage == nil || rec.Usage.CompletionTokens != 6 || rec.Outcome != OutcomeCompleted {
		t.Errorf("record %+v", rec)
	}

	// The same request, not streamed: the same text and usage.
	r := postJSON(t, f, APIResponses, strings.Replace(body, `"stream":true`, `"stream":false`, 1))
	var full struct {
		Object string `json:"object"`
		Status string `json:"status"`
		Output []struct {
			Type    string `json:"type"`
			Content []struct {
				Type, Text string
			} `json:"content"`
		} `json:"output"`
		Usage map[string]any `json:"usage"`
	}
	if err := json.Unmarshal(r, &full); err != nil || full.Object != "response" || full.Status != "completed" || len(full.Output) != 1 ||
		len(full.Output[0].Content) != 1 || full.Output[0].Content[0].Text != a.text {
		t.Errorf("JSON response %s (%v); want status completed with the streamed text %q", r, err, a.text)
	}
	if full.Usage["output_tokens"] != 6.0 {
		t.Errorf("JSON usage %v", full.Usage)
	}
}

// postJSON posts a non-streaming request and returns the 200 body.
func postJSON(t *testing.T, f *Fleet, a API, body string, headers ...string) []byte {
	t.Helper()
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+a.Path(), body, headers...)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b := readAll(t, resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: status %d: %s", a.Path(), resp.StatusCode, b)
	}
	return b
}

// TestResponsesMaxOutputTokensEndsIncomplete: max_output_tokens below the
// tokens to generate ends the stream with response.incomplete,
// incomplete_details.reason max_output_tokens and that many output tokens.
func TestResponsesMaxOutputTokensEndsIncomplete(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	_, evs, err := streamAPI(t, f, APIResponses, `{"input":"hi","max_output_tokens":3,"stream":true}`)
	if err != nil {
		t.Fatal(err)
	}
	a := &responsesAccumulator{t: t}
	for _, e := range evs {
		a.add(e)
	}
	last := typed(t, evs[len(evs)-1])
	if a.terminal != "response.incomplete" || a.usage["output_tokens"] != 3.0 {
		t.Fatalf("terminal %s, usage %v; want response.incomplete with 3 output tokens", a.terminal, a.usage)
	}
	if r := last["response"].(map[string]any); fmt.Sprint(r["incomplete_details"]) != "map[reason:max_output_tokens]" || r["max_output_tokens"] != 3.0 {
		t.Errorf("response.incomplete: %s", evs[len(evs)-1].data)
	}
}

// TestResponsesFaults: error_event=0 is lifecycle-then-error (created,
// in_progress, error); error_event=2 with response_failed ends with
// response.failed after two deltas; cut=2 closes after two deltas with no
// terminal event; status=503 answers vLLM's JSON error.
func TestResponsesFaults(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	body := `{"input":"hi","stream":true}`
	cases := []struct {
		fault, names, terminal string
		code                   string
	}{
		{"error_event=0,error_code=503", "response.created response.in_progress error", "error", "server_error"},
		{"error_event=0,error_code=429", "response.created response.in_progress error", "error", "rate_limit_exceeded"},
		{"error_event=2,response_failed", "response.created response.in_progress response.output_item.added response.content_part.added response.output_text.delta response.output_text.delta response.failed", "response.failed", "server_error"},
		{"cut=2", "response.created response.in_progress response.output_item.added response.content_part.added response.output_text.delta response.output_text.delta", "", ""},
	}
	for _, c := range cases {
		t.Run(c.fault, func(t *testing.T) {
			_, evs, _ := streamAPI(t, f, APIResponses, body, "X-Mock-Fault: "+c.fault)
			a := &responsesAccumulator{t: t}
			var names []string
			for _, e := range evs {
				a.add(e)
				names = append(names, e.name)
			}
			if got := strings.Join(names, " "); got != c.names {
				t.Errorf("events %q, want %q", got, c.names)
			}
			if a.terminal != c.terminal {
				t.Errorf("terminal %q, want %q", a.terminal, c.terminal)
			}
			if c.code == "" {
				return
			}
			m := typed(t, evs[len(evs)-1])
			code := m["code"]
			if r, ok := m["response"].(map[string]any); ok {
				code = r["error"].(map[string]any)["code"]
			}
			if code != c.code {
				t.Errorf("error code %v, want %s: %s", code, c.code, evs[len(evs)-1].data)
			}
		})
	}
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/responses", body, "X-Mock-Fault: status=503")
	if err != nil {
		t.Fatal(err)
	}
	b := readAll(t, resp.Body)
	resp.Body.Close()
	var e errorBody
	if resp.StatusCode != 503 || json.Unmarshal(b, &e) != nil || e.Error.Code != 503 || e.Error.Message == "" {
		t.Errorf("status fault: %d %s", resp.StatusCode, b)
	}
}

// TestMessagesStreamParsesAsTheSDKsExpect: a Messages stream is named
// events the Anthropic SDK's MessageStream takes: message_start (usage
// with input and cache tokens) and ping at once, before the TTFT; text
// deltas that add up to the non-streamed text; message_delta twice with
// cumulative output_tokens (half, then all) and the last carrying
// stop_reason end_turn; message_stop. An x-api-key is noted, never
// recorded.
func TestMessagesStreamParsesAsTheSDKsExpect(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: Behavior{TTFT: Fixed(150 * time.Millisecond), Tokens: 6, TokenInterval: NoDelay}})
	body := `{"model":"m1","system":"be brief","messages":[{"role":"user","content":"hi"}],"max_tokens":100,"stream":true}`
	start := time.Now()
	resp, evs, err := streamAPI(t, f, APIMessages, body, "X-Request-Id: m1", "x-api-key: sk-ant-secret", "anthropic-version: 2023-06-01")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("status %d, %v", resp.StatusCode, err)
	}
	a := &messagesAccumulator{t: t}
	var names []string
	for _, e := range evs {
		a.add(e)
		names = append(names, e.name)
	}
	want := "message_start ping content_block_start content_block_delta content_block_delta content_block_delta message_delta" +
		" content_block_delta content_block_delta content_block_delta content_block_stop message_delta message_stop"
	if got := strings.Join(names, " "); got != want {
		t.Errorf("events:\n%s\nwant\n%s", got, want)
	}
	if d := evs[1].at.Sub(start); d > 100*time.Millisecond {
		t.Errorf("ping came %v after the request; message_start and ping come at once, before the 150ms TTFT", d)
	}
	if d := evs[2].at.Sub(start); d < 150*time.Millisecond {
		t.Errorf("the first content block came %v after the request, before the TTFT", d)
	}
	if !a.stopped || a.stop != "end_turn" || fmt.Sprint(a.output) != "[3 6]" {
		t.Errorf("stopped %v, stop_reason %v, message_delta output_tokens %v; want true, end_turn, [3 6] (cumulative)", a.stopped, a.stop, a.output)
	}
	if a.message["id"] != "msg_m1" {
		t.Errorf("message id %v, want msg_m1", a.message["id"])
	}
	u := a.message["usage"].(map[string]any)
	if u["cache_creation_input_tokens"] != 0.0 || u["cache_read_input_tokens"] != 0.0 {
		t.Errorf("message_start usage %v, want cache token counts", u)
	}
	rec := lastRecord(t, f.Replica(0))
	if rec.API != APIMessages || rec.Usage == nil || rec.Usage.CompletionTokens != 6 || rec.Usage.PromptTokens != int(u["input_tokens"].(float64)) {
		t.Errorf("record %+v, usage %+v; want the usage the stream reported", rec, rec.Usage)
	}
	if !rec.APIKey || rec.Headers["x-api-key"] != "" || rec.Headers["anthropic-version"] != "2023-06-01" {
		t.Errorf("record: api_key %v, headers %v; want x-api-key noted but not recorded, anthropic-version recorded", rec.APIKey, rec.Headers)
	}

	b := postJSON(t, f, APIMessages, strings.Replace(body, `"stream":true`, `"stream":false`, 1))
	var full struct {
		Type       string `json:"type"`
		StopReason string `json:"stop_reason"`
		Content    []struct{ Type, Text string }
		Usage      struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		}
	}
	if err := json.Unmarshal(b, &full); err != nil || full.Type != "message" || full.StopReason != "end_turn" || len(full.Content) != 1 ||
		full.Content[0].Text != a.text || full.Usage.OutputTokens != 6 {
		t.Errorf("JSON message %s (%v); want the streamed text %q", b, err, a.text)
	}
	// max_tokens below the tokens: stop_reason max_tokens.
	_, evs, _ = streamAPI(t, f, APIMessages, `{"messages":[],"max_tokens":2,"stream":true}`)
	a = &messagesAccumulator{t: t}
	for _, e := range evs {
		a.add(e)
	}
	if a.stop != "max_tokens" || fmt.Sprint(a.output) != "[1 2]" {
		t.Errorf("max_tokens 2: stop_reason %v, output_tokens %v; want max_tokens, [1 2]", a.stop, a.output)
	}
}

// TestMessagesFaults: error_event=0 is message_start + ping then an error
// event of the type the code picks (or error_type names); a later error
// follows content; cut leaves no message_stop; a status fault answers
// Anthropic's error body.
func TestMessagesFaults(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	body := `{"messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}`
	cases := []struct{ fault, names, errType string }{
		{"error_event=0,error_code=529", "message_start ping error", "overloaded_error"},
		{"error_event=0,error_code=503", "message_start ping error", "overloaded_error"},
		{"error_event=0", "message_start ping error", "api_error"},
		{"error_event=0,error_code=400", "message_start ping error", "invalid_request_error"},
		{"error_event=0,error_code=429", "message_start ping error", "rate_limit_error"},
		{"error_event=0,error_type=authentication_error", "message_start ping error", "authentication_error"},
		{"error_event=1,error_code=529", "message_start ping content_block_start content_block_delta error", "overloaded_error"},
		{"cut=1", "message_start ping content_block_start content_block_delta", ""},
	}
	for _, c := range cases {
		t.Run(c.fault, func(t *testing.T) {
			_, evs, _ := streamAPI(t, f, APIMessages, body, "X-Mock-Fault: "+c.fault)
			a := &messagesAccumulator{t: t}
			var names []string
			for _, e := range evs {
				a.add(e)
				names = append(names, e.name)
			}
			if got := strings.Join(names, " "); got != c.names {
				t.Errorf("events %q, want %q", got, c.names)
			}
			if a.errType != c.errType || a.stopped {
				t.Errorf("error type %q, stopped %v; want %q, false", a.errType, a.stopped, c.errType)
			}
		})
	}
	for _, c := range []struct {
		status  int
		errType string
	}{{529, "overloaded_error"}, {503, "overloaded_error"}, {500, "api_error"}, {429, "rate_limit_error"}, {400, "invalid_request_error"}, {401, "authentication_error"}} {
		resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/messages", body, fmt.Sprintf("X-Mock-Fault: status=%d", c.status))
		if err != nil {
			t.Fatal(err)
		}
		b := readAll(t, resp.Body)
		resp.Body.Close()
		var e struct {
			Type  string `json:"type"`
			Error struct{ Type, Message string }
		}
		if resp.StatusCode != c.status || json.Unmarshal(b, &e) != nil || e.Type != "error" || e.Error.Type != c.errType || e.Error.Message == "" {
			t.Errorf("status=%d: %d %s; want Anthropic's {\"type\":\"error\",\"error\":{\"type\":%q,…}}", c.status, resp.StatusCode, b, c.errType)
		}
	}
}

// TestAPIsShareTheTextOfAPrompt: the four APIs carry the same generated
// text for the same prompt bytes (the seed is the prompt's raw JSON), so
// tests can compare across APIs and replicas.
func TestAPIsShareTheTextOfAPrompt(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	msgs := `[{"role":"user","content":"same"}]`
	var texts []string
	for _, c := range []struct {
		a    API
		body string
		get  func(b []byte) string
	}{
		{APIChat, `{"messages":` + msgs + `}`, func(b []byte) string {
			var v struct {
				Choices []struct{ Message struct{ Content string } }
			}
			json.Unmarshal(b, &v)
			return v.Choices[0].Message.Content
		}},
		{APIResponses, `{"input":` + msgs + `}`, func(b []byte) string {
			var v struct {
				Output []struct{ Content []struct{ Text string } }
			}
			json.Unmarshal(b, &v)
			return v.Output[0].Content[0].Text
		}},
		{APIMessages, `{"messages":` + msgs + `,"max_tokens":100}`, func(b []byte) string {
			var v struct{ Content []struct{ Text string } }
			json.Unmarshal(b, &v)
			return v.Content[0].Text
		}},
	} {
		texts = append(texts, c.get(postJSON(t, f, c.a, c.body)))
	}
	if texts[0] == "" || texts[0] != texts[1] || texts[1] != texts[2] {
		t.Errorf("texts %q differ", texts)
	}
}

// TestCountTokensIsNotACompletion: /v1/messages/count_tokens answers the
// input tokens a Messages request would report, and is not counted as a
// request.
func TestCountTokensIsNotACompletion(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast})
	body := `{"model":"m","system":"s","messages":[{"role":"user","content":"count me"}],"max_tokens":5}`
	b := postJSON(t, f, APIMessages, body)
	var full struct {
		Usage struct {
			InputTokens int `json:"input_tokens"`
		}
	}
	json.Unmarshal(b, &full)
	resp, err := post(t, client(t), context.Background(), f.Replica(0).URL()+"/v1/messages/count_tokens", body)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var ct struct {
		InputTokens int `json:"input_tokens"`
	}
	if err := json.Unmarshal(readAll(t, resp.Body), &ct); err != nil || resp.StatusCode != 200 || ct.InputTokens != full.Usage.InputTokens || ct.InputTokens == 0 {
		t.Errorf("count_tokens: %d, %+v (%v); want input_tokens %d", resp.StatusCode, ct, err, full.Usage.InputTokens)
	}
	if n := f.Replica(0).Stats().Requests; n != 1 {
		t.Errorf("requests %d, want 1 (count_tokens is not a completion)", n)
	}
}
