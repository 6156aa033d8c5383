// Package bodyburst sends a burst of concurrent requests with large bodies
// to a gateway and measures what they cost the gateway's process in memory
// (a burst of large prompts must not take a small box down). It is shared by cmd/bodyburst (scripts/bench-bodies.sh) and the
// end-to-end test of the body budget.
package bodyburst

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/dustin/go-humanize"
)

// Config is one burst.
type Config struct {
	// URL is the chat completions endpoint, e.g.
	// http://127.0.0.1:8080/v1/chat/completions.
	URL string
	// Bodies is the number of concurrent requests.
	Bodies int
	// Size is each body's size in bytes (a chat request whose one message
	// fills it).
	Size int
	// Model is the request's model; default "mock-llama".
	Model string
	// PID is the gateway's process id, whose RSS is measured; 0 measures
	// nothing.
	PID int
	// Timeout bounds the whole burst; default 60s.
	Timeout time.Duration
}

// Result is what a burst did.
type Result struct {
	Bodies, Size int
	// Admitted were answered 200; Refused 503 with Retry-After and code
	// body_memory_exhausted; Other anything else (a status or an error in
	// Errors): a lost request.
	Admitted, Refused, Other int
	Errors                   []string
	// RSSBefore is the process's resident memory before the burst;
	// RSSPeak its high-water mark during the burst (VmHWM, reset through
	// clear_refs before it when the kernel allows; else since the
	// process started); RSSAfter after it. Bytes; 0 when not measured.
	RSSBefore, RSSPeak, RSSAfter int64
}

// Growth is the peak RSS less the RSS before the burst.
func (r *Result) Growth() int64 { return max(r.RSSPeak-r.RSSBefore, 0) }

// AdmittedBytes is the bytes of the bodies admitted.
func (r *Result) AdmittedBytes() int64 { return int64(r.Admitted) * int64(r.Size) }

// Ratio is Growth over AdmittedBytes, 0 when nothing was admitted.
func (r *Result) Ratio() float64 {
	if r.Admitted == 0 {
		return 0
	}
	return float64(r.Growth()) / float64(r.AdmittedBytes())
}

// Body returns a chat completion request of exactly size bytes (at least
// the envelope's length).
func Body(model string, size int) []byte {
	head := `{"model":` + strconv.Quote(model) + `,"stream":false,"max_tokens":1,"messages":[{"role":"user","content":"`
	tail := `"}]}`
	n := max(size-len(head)-len(tail), 0)
	b := make([]byte, 0, len(head)+n+len(tail))
	b = append(b, head...)
	b = append(b, bytes.Repeat([]byte("a"), n)...)
	return append(b, tail...)
}

// Run sends the burst and waits for every answer.
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if cfg.Model == "" {
		cfg.Model = "mock-llama"
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 60 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	res := &Result{Bodies: cfg.Bodies, Size: cfg.Size}
	body := Body(cfg.Model, cfg.Size)
	if cfg.PID > 0 {
		rss, _, err := ProcMem(cfg.PID)
		if err != nil {
			return nil, err
		}
		res.RSSBefore = rss
		// Reset the high-water mark (Linux ≥ 4.0); without it the peak
		// is since the process started, which only overstates.
		_ = os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", cfg.PID), []byte("5"), 0)
	}
	tr := &http.Transport{MaxIdleConnsPerHost: cfg.Bodies, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range cfg.Bodies {
		wg.Go(func() {
			<-start
			status, err := send(ctx, client, cfg.URL, body)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err != nil:
				res.Other++
				res.Errors = append(res.Errors, err.Error())
			case status == http.StatusOK:
				res.Admitted++
			case status == http.StatusServiceUnavailable:
				res.Refused++
			default:
				res.Other++
				res.Errors = append(res.Errors, "status "+strconv.Itoa(status))
			}
		})
	}
	close(start)
	wg.Wait()
	if cfg.PID > 0 {
		rss, hwm, err := ProcMem(cfg.PID)
		if err != nil {
			return nil, err
		}
		res.RSSAfter, res.RSSPeak = rss, max(hwm, rss)
	}
	return res, nil
}

// send posts body and returns the status; a 503 counts only with
// Retry-After and the gateway's body_memory_exhausted code (any other 503
// is reported as an error).
func send(ctx context.Context, c *http.Client, url string, body []byte) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if resp.StatusCode == http.StatusServiceUnavailable {
		var e struct {
			Error struct{ Code string } `json:"error"`
		}
		_ = json.Unmarshal(b, &e)
		if resp.Header.Get("Retry-After") == "" || e.Error.Code != "body_memory_exhausted" {
			return 0, fmt.Errorf("503 without Retry-After or code body_memory_exhausted: %s", b)
		}
	}
	return resp.StatusCode, nil
}

// ProcMem returns the resident memory (VmRSS) and its high-water mark
// (VmHWM) of process pid, in bytes, from /proc/<pid>/status.
func ProcMem(pid int) (rss, hwm int64, err error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, value, ok := strings.Cut(sc.Text(), ":")
		if !ok || (name != "VmRSS" && name != "VmHWM") {
			continue
		}
		kb, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(value), " kB"), 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("/proc/%d/status %s: %w", pid, name, err)
		}
		if name == "VmRSS" {
			rss = kb << 10
		} else {
			hwm = kb << 10
		}
	}
	return rss, hwm, sc.Err()
}

// Markdown is the result as a markdown table.
func (r *Result) Markdown() string {
	var b strings.Builder
	b.WriteString("| bodies | admitted | refused (503) | lost | RSS before | RSS peak | RSS after | growth | growth ÷ admitted bodies |\n")
	b.WriteString("|---|---|---|---|---|---|---|---|---|\n")
	fmt.Fprintf(&b, "| %d × %s | %d | %d | %d | %s | %s | %s | %s | %.2f× |\n",
		r.Bodies, humanize.IBytes(uint64(r.Size)), r.Admitted, r.Refused, r.Other,
		humanize.IBytes(uint64(r.RSSBefore)), humanize.IBytes(uint64(r.RSSPeak)), humanize.IBytes(uint64(r.RSSAfter)),
		humanize.IBytes(uint64(r.Growth())), r.Ratio())
	return b.String()
}
