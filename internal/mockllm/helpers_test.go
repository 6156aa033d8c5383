package mockllm

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// fast is a Behavior quick enough for unit tests.
var fast = Behavior{TTFT: Fixed(5 * time.Millisecond), Tokens: 5, TokenInterval: 2 * time.Millisecond}

func startFleet(t *testing.T, cfg FleetConfig) *Fleet {
	t.Helper()
	if cfg.Seed == 0 {
		cfg.Seed = 1
	}
	f, err := StartFleet(cfg)
	if err != nil {
		t.Fatalf("StartFleet: %v", err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

// client returns an HTTP client of its own, so that connections do not
// leak between tests.
func client(t *testing.T) *http.Client {
	t.Helper()
	tr := &http.Transport{DisableCompression: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

const chatBody = `{"model":"m1","messages":[{"role":"user","content":"hi"}],"stream":true}`

// post sends a completion request with the given X-Mock-* headers
// ("Name: value" strings).
func post(t *testing.T, c *http.Client, ctx context.Context, url, body string, headers ...string) (*http.Response, error) {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	for _, h := range headers {
		k, v, _ := strings.Cut(h, ":")
		req.Header.Set(strings.TrimSpace(k), strings.TrimSpace(v))
	}
	return c.Do(req)
}

// sse is a parsed event stream.
type sse struct {
	data     []string // data payloads in order
	comments int
	err      error // the error that ended the read, nil on a clean EOF
}

// readSSE parses events until EOF or an error.
func readSSE(r io.Reader) sse {
	var s sse
	br := bufio.NewReader(r)
	var cur []string
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			switch {
			case !errors.Is(err, io.EOF):
				s.err = err
			case line != "" || cur != nil:
				s.err = io.ErrUnexpectedEOF
			}
			return s
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "":
			if cur != nil {
				s.data = append(s.data, strings.Join(cur, "\n"))
				cur = nil
			}
		case strings.HasPrefix(line, ":"):
			s.comments++
		case strings.HasPrefix(line, "data: "):
			cur = append(cur, strings.TrimPrefix(line, "data: "))
		}
	}
}

// chunkOf decodes a chunk payload.
func chunkOf(t *testing.T, data string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(data), &m); err != nil {
		t.Fatalf("chunk %q: %v", data, err)
	}
	return m
}

// choice0 returns the first choice of a chunk.
func choice0(t *testing.T, m map[string]any) map[string]any {
	t.Helper()
	cs, _ := m["choices"].([]any)
	if len(cs) == 0 {
		t.Fatalf("chunk without choices: %v", m)
	}
	return cs[0].(map[string]any)
}

// contentEvents counts the data events that carry a token.
func contentEvents(t *testing.T, s sse) int {
	t.Helper()
	n := 0
	for _, d := range s.data {
		if d == "[DONE]" || strings.HasPrefix(d, `{"error"`) {
			continue
		}
		m := chunkOf(t, d)
		cs, _ := m["choices"].([]any)
		if len(cs) == 0 {
			continue
		}
		c := cs[0].(map[string]any)
		if d, ok := c["delta"].(map[string]any); ok {
			if _, role := d["role"]; role {
				continue
			}
		}
		n++
	}
	return n
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %s waiting for %s", within, what)
		}
		time.Sleep(time.Millisecond)
	}
}

// lastRecord returns the replica's most recent request record, once it
// has ended (the client may see a fault before the server records it).
func lastRecord(t *testing.T, r *Replica) RequestRecord {
	t.Helper()
	var rec RequestRecord
	waitFor(t, time.Second, "the last request to end", func() bool {
		s := r.Stats()
		if len(s.Recent) == 0 {
			return false
		}
		rec = s.Recent[len(s.Recent)-1]
		return rec.Outcome != OutcomeInFlight
	})
	return rec
}

func readAll(t *testing.T, r io.Reader) []byte {
	t.Helper()
	var b bytes.Buffer
	if _, err := b.ReadFrom(r); err != nil {
		t.Fatalf("read body: %v", err)
	}
	return b.Bytes()
}

// scrape fetches base + "/metrics" and returns the body; the status must
// be 200.
func scrape(t *testing.T, c *http.Client, base string) string {
	t.Helper()
	resp, err := c.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body := readAll(t, resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: status %d: %s", resp.StatusCode, body)
	}
	return string(body)
}

// families parses a text exposition.
func families(t *testing.T, body string) map[string]*dto.MetricFamily {
	t.Helper()
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("parse metrics: %v\n%s", err, body)
	}
	return fams
}

// series returns the only series of family name in body.
func series(t *testing.T, body, name string) *dto.Metric {
	t.Helper()
	f := families(t, body)[name]
	if f == nil || len(f.GetMetric()) != 1 {
		t.Fatalf("want one series of %s in:\n%s", name, body)
	}
	return f.GetMetric()[0]
}

// gauge is the value of the only series of gauge name in body.
func gauge(t *testing.T, body, name string) float64 {
	t.Helper()
	return series(t, body, name).GetGauge().GetValue()
}

// histogram is the only series of histogram name in body.
func histogram(t *testing.T, body, name string) *dto.Histogram {
	t.Helper()
	return series(t, body, name).GetHistogram()
}
