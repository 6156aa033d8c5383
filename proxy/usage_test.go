package proxy

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

const usageOnly = "data: {\"id\":\"c1\",\"choices\":[],\"usage\":{\"prompt_tokens\":11,\"completion_tokens\":7,\"total_tokens\":18}}\n\n"

// With RequestUsage on, a streaming client that did not ask for usage gets
// stream_options.include_usage added upstream, every other byte as it sent
// it, and never sees the usage-only chunk, whose counts land in the Result.
func TestUsageRequestedOnTheClientsBehalf(t *testing.T) {
	cases := []struct {
		name, body, want string
	}{
		{
			name: "no stream_options",
			body: "{ \"model\" : \"m\",\n  \"stream\": true, \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9 🙂\"}] }\n",
			want: "{ \"model\" : \"m\",\n  \"stream\": true, \"messages\":[{\"role\":\"user\",\"content\":\"h\\u00e9 🙂\"}] ,\"stream_options\":{\"include_usage\":true}}\n",
		},
		{
			name: "include_usage false",
			body: `{"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":false},"n":1}`,
			want: `{"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":false},"n":1}`,
		},
		{
			name: "stream_options without include_usage",
			body: `{"stream_options":{ },"stream":true}`,
			want: `{"stream_options":{ "include_usage":true},"stream":true}`,
		},
		{
			name: "stream_options null",
			body: `{"stream":true,"stream_options":null,"x":[1, 2]}`,
			want: `{"stream":true,"stream_options":{"include_usage":true},"x":[1, 2]}`,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, sseUpstream(": ping\n\n", chunkA, chunkB, chunkEnd, usageOnly, done))
			p, _, obs := newTestProxy(t, Config{RequestUsage: true}, up)
			w := httptest.NewRecorder()
			res := p.ServeHTTP(w, post(tc.body))
			if got := up.bodies[0]; !bytes.Equal(got, []byte(tc.want)) {
				t.Fatalf("upstream body\n%q\nwant\n%q", got, tc.want)
			}
			if got, want := w.Body.String(), ": ping\n\n"+chunkA+chunkB+chunkEnd+done; got != want {
				t.Fatalf("client body\n%q\nwant\n%q", got, want)
			}
			if res.Outcome != OutcomeSuccess || res.Usage != (Usage{PromptTokens: 11, CompletionTokens: 7, Reported: true}) {
				t.Fatalf("outcome %v usage %+v", res.Outcome, res.Usage)
			}
			if res.Events != 5 || res.ContentEvents != 3 || obs.events != 5 {
				t.Fatalf("events %d, content events %d, observed %d: the usage chunk is not relayed", res.Events, res.ContentEvents, obs.events)
			}
		})
	}
}

// A client that asked for usage gets everything untouched, both ways.
func TestUsageAskedForByTheClientPassesThrough(t *testing.T) {
	for _, body := range []string{
		`{"stream":true,"stream_options":{"include_usage":true}}`,
		"{\"stream\":true, \"stream_options\": {\"include_usage\": true, \"continuous_usage_stats\": true}}\n",
	} {
		up := newUpstream(t, sseUpstream(chunkA, chunkEnd, usageOnly, done))
		p, _, _ := newTestProxy(t, Config{RequestUsage: true}, up)
		w := httptest.NewRecorder()
		res := p.ServeHTTP(w, post(body))
		if got := string(up.bodies[0]); got != body {
			t.Fatalf("upstream body %q, want the client's %q", got, body)
		}
		if got, want := w.Body.String(), chunkA+chunkEnd+usageOnly+done; got != want {
			t.Fatalf("client body %q, want %q", got, want)
		}
		if res.Usage != (Usage{PromptTokens: 11, CompletionTokens: 7, Reported: true}) {
			t.Fatalf("usage %+v", res.Usage)
		}
	}
}

// Without RequestUsage, and for requests that do not stream, the body and
// the stream are untouched.
func TestUsageNotRequestedWhenOffOrNotStreaming(t *testing.T) {
	cases := []struct {
		name string
		cfg  Config
		body string
	}{
		{"RequestUsage off", Config{}, `{"stream":true}`},
		{"not streaming", Config{RequestUsage: true}, `{"stream":false}`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up := newUpstream(t, sseUpstream(chunkA, chunkEnd, usageOnly, done))
			p, _, _ := newTestProxy(t, tc.cfg, up)
			w := httptest.NewRecorder()
			p.ServeHTTP(w, post(tc.body))
			if string(up.bodies[0]) != tc.body || w.Body.String() != chunkA+chunkEnd+usageOnly+done {
				t.Fatalf("upstream body %q, client body %q", up.bodies[0], w.Body)
			}
		})
	}
}

// Cumulative usage on every content chunk (TGI): the chunks carry content,
// so they are relayed, and the last value counts, never a sum.
func TestCumulativeUsageIsTheLastValue(t *testing.T) {
	tgi := func(content string, completion int) string {
		return "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"" + content + "\"},\"finish_reason\":null}],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":" + itoa(completion) + "}}\n\n"
	}
	events := []string{tgi("a", 1), tgi("b", 2), tgi("c", 3), chunkEnd, done}
	up := newUpstream(t, sseUpstream(events...))
	p, _, _ := newTestProxy(t, Config{RequestUsage: true}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if w.Body.String() != strings.Join(events, "") {
		t.Fatalf("client body %q", w.Body)
	}
	if res.Usage != (Usage{PromptTokens: 4, CompletionTokens: 3, Reported: true}) {
		t.Fatalf("usage %+v, want the last chunk's", res.Usage)
	}
}

// Every attempt sends the identical edited body.
func TestEveryAttemptSendsTheEditedBody(t *testing.T) {
	bad := newUpstream(t, func(w http.ResponseWriter, r *http.Request) { http.Error(w, "down", 503) })
	good := newUpstream(t, sseUpstream(chunkA, chunkEnd, usageOnly, done))
	p, _, _ := newTestProxy(t, Config{RequestUsage: true, MaxAttempts: 2}, bad, good)
	body := `{"stream":true,"messages":[{"role":"user","content":"` + strings.Repeat("x", 100<<10) + `"}]}`
	want := strings.TrimSuffix(body, "}") + `,"stream_options":{"include_usage":true}}`
	res := p.ServeHTTP(httptest.NewRecorder(), post(body))
	if res.Outcome != OutcomeSuccess || res.Attempts != 2 {
		t.Fatalf("outcome %v attempts %d", res.Outcome, res.Attempts)
	}
	for _, u := range []*upstream{bad, good} {
		if len(u.bodies) != 1 || string(u.bodies[0]) != want {
			t.Fatalf("upstream %s did not get the edited body", u.addr())
		}
	}
}

// A usage-only chunk before any content (an empty completion) does not
// commit the stream and is not relayed.
func TestUsageOnlyChunkFirstDoesNotCommit(t *testing.T) {
	up := newUpstream(t, sseUpstream(usageOnly, done))
	p, _, _ := newTestProxy(t, Config{RequestUsage: true}, up)
	w := httptest.NewRecorder()
	res := p.ServeHTTP(w, post(`{"stream":true}`))
	if w.Body.String() != done || res.Outcome != OutcomeSuccess || !res.Usage.Reported || res.ContentEvents != 0 {
		t.Fatalf("client body %q outcome %v usage %+v content %d", w.Body, res.Outcome, res.Usage, res.ContentEvents)
	}
}
