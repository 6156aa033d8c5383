package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"time"
)

// Outcome kinds of one request. HTTP statuses other than 200 are reported
// as "http_<status>".
const (
	OutcomeOK         = "ok"          // the response carried a finish_reason or [DONE]
	OutcomeTruncated  = "truncated"   // the stream ended (EOF or read error) without finishing
	OutcomeErrorEvent = "error_event" // an in-band error event (or a 200 JSON error body)
	OutcomeTransport  = "transport"   // no response: dial, reset, TLS or protocol error
	OutcomeTimeout    = "timeout"     // --timeout expired before the response finished
	OutcomeCancelled  = "cancelled"   // llmload stopped (deadline or signal) while in flight
)

// UpstreamHeader is the response header that names the mock replica that
// served the request; the gateway passes it through.
const UpstreamHeader = "X-Mock-Replica"

// maxEventBytes bounds one SSE line; a longer line ends the request as
// truncated instead of growing memory without limit.
const maxEventBytes = 1 << 20

// Result is what one request measured.
type Result struct {
	// Start is when the request was sent.
	Start time.Time
	// Status is the HTTP status, 0 when no response arrived.
	Status int
	// Upstream is the X-Mock-Replica response header, "" when absent.
	Upstream string
	// Outcome is one of the Outcome* constants or "http_<status>".
	Outcome string
	// Detail says what went wrong for outcomes other than ok.
	Detail string
	// Code is the "code" of an error response's OpenAI error body (e.g.
	// tenant_concurrency), "" when none.
	Code string
	// TTFT is the time from sending the request to the first data event
	// (streaming Chat and Completions), to the first generated event
	// (Responses: a *.delta; Messages: content_block_delta or a tool_use
	// block's start; never a lifecycle event such as response.created or
	// message_start), or to the complete body (non-streaming); valid if
	// HasTTFT.
	TTFT    time.Duration
	HasTTFT bool
	// Gaps are the times between consecutive data events (Responses and
	// Messages: generated events).
	Gaps []time.Duration
	// Total is the time from sending the request to the end of the response.
	Total time.Duration
	// Events counts data events (including [DONE]).
	Events int
	// Bytes counts response body bytes read.
	Bytes int64
	// FinishReason is the last non-null finish_reason seen (Responses:
	// the final status; Messages: the stop_reason).
	FinishReason string
}

// OK reports whether the request finished successfully.
func (r *Result) OK() bool { return r.Outcome == OutcomeOK }

// Requester sends identical requests to one URL and measures them.
type Requester struct {
	// Client sends the requests; see newHTTPClient.
	Client *http.Client
	// URL is the endpoint, e.g. http://127.0.0.1:8089/v1/chat/completions.
	URL string
	// Body is the request body, sent unchanged on every request.
	Body []byte
	// Header is added to every request.
	Header http.Header
	// Timeout bounds one request (0: no bound beyond the context).
	Timeout time.Duration
	// API is the API spoken (APIChat when empty): it says which events
	// are generated, which ends a stream and which is an error.
	API string
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

// Do sends one request and measures it. It never returns an error: every
// failure is an outcome in the Result. The context cancels the request; its
// cancellation is reported as OutcomeCancelled.
func (q *Requester) Do(ctx context.Context) (res Result) {
	if q.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, q.Timeout)
		defer cancel()
	}
	res.Start = time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, q.URL, bytes.NewReader(q.Body))
	if err != nil {
		res.Outcome, res.Detail = OutcomeTransport, err.Error()
		return res
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream, application/json")
	for k, vs := range q.Header {
		for _, v := range vs {
			req.Header.Add(k, v)
		}
	}
	resp, err := q.Client.Do(req)
	if err != nil {
		res.Total = time.Since(res.Start)
		res.Outcome, res.Detail = failureOutcome(ctx, err, OutcomeTransport)
		return res
	}
	defer resp.Body.Close()
	res.Status = resp.StatusCode
	res.Upstream = resp.Header.Get(UpstreamHeader)
	body := &countingReader{r: resp.Body}
	defer func() { res.Bytes = body.n }()

	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(body, 4096))
		res.Total = time.Since(res.Start)
		res.Outcome = fmt.Sprintf("http_%d", resp.StatusCode)
		res.Detail = errorMessage(msg)
		res.Code = errorCodeOf(msg)
		return res
	}
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		q.readStream(ctx, body, &res)
	} else {
		readJSON(ctx, q.API, body, &res)
	}
	res.Total = time.Since(res.Start)
	return res
}

// readStream reads an SSE body, timing each data event when the blank line
// that ends it arrives.
func (q *Requester) readStream(ctx context.Context, body io.Reader, res *Result) {
	br := bufio.NewReaderSize(body, 16<<10)
	var (
		data     []byte // data of the event being read
		name     []byte // its event: field
		hasData  bool
		last     time.Time
		finished bool // finish_reason or [DONE] seen
	)
	typed := q.API == APIResponses || q.API == APIMessages
	dispatch := func() (stop bool) {
		if !hasData {
			name = name[:0]
			return false
		}
		now := time.Now()
		if typed {
			k, finish, msg := classifyEvent(q.API, string(name), bytes.TrimSpace(data))
			data, name, hasData = data[:0], name[:0], false
			res.Events++
			if finish != "" {
				res.FinishReason = finish
			}
			switch k {
			case eventGenerated:
				if !res.HasTTFT {
					res.TTFT, res.HasTTFT = now.Sub(res.Start), true
				} else {
					res.Gaps = append(res.Gaps, now.Sub(last))
				}
				last = now
			case eventEnd:
				finished = true
				return true
			case eventError:
				res.Outcome, res.Detail = OutcomeErrorEvent, msg
				return true
			}
			return false
		}
		res.Events++
		if !res.HasTTFT {
			res.TTFT, res.HasTTFT = now.Sub(res.Start), true
		} else {
			res.Gaps = append(res.Gaps, now.Sub(last))
		}
		last = now
		d := bytes.TrimSpace(data)
		data, hasData = data[:0], false
		if bytes.Equal(d, []byte("[DONE]")) {
			finished = true
			return true
		}
		if msg, ok := inBandError(d); ok {
			res.Outcome, res.Detail = OutcomeErrorEvent, msg
			return true
		}
		if fr := finishReason(d); fr != "" {
			res.FinishReason = fr
			finished = true
		}
		return false
	}
	for {
		line, err := readLine(br)
		if err != nil {
			// Be lenient: a last event without its blank line still counts.
			if errors.Is(err, io.EOF) {
				dispatch()
			}
			switch {
			case res.Outcome != "":
			case finished:
				res.Outcome = OutcomeOK
			case ctx.Err() != nil:
				res.Outcome, res.Detail = failureOutcome(ctx, err, OutcomeTruncated)
			case errors.Is(err, io.EOF):
				res.Outcome, res.Detail = OutcomeTruncated, fmt.Sprintf("stream ended after %d events without finish_reason or [DONE]", res.Events)
			default:
				res.Outcome, res.Detail = OutcomeTruncated, fmt.Sprintf("after %d events: %v", res.Events, err)
			}
			return
		}
		switch {
		case len(line) == 0:
			if dispatch() {
				if res.Outcome == "" {
					res.Outcome = OutcomeOK
				}
				return
			}
		case line[0] == ':':
			// comment (keep-alive)
		case bytes.HasPrefix(line, []byte("event:")):
			name = append(name[:0], bytes.TrimSpace(line[6:])...)
		case bytes.HasPrefix(line, []byte("data:")):
			v := line[5:]
			if len(v) > 0 && v[0] == ' ' {
				v = v[1:]
			}
			if hasData {
				data = append(data, '\n')
			}
			data = append(data, v...)
			hasData = true
		}
	}
}

// readLine returns one line without its LF or CRLF, bounded by maxEventBytes.
// The returned slice is valid until the next call.
func readLine(br *bufio.Reader) ([]byte, error) {
	line, err := br.ReadSlice('\n')
	if errors.Is(err, bufio.ErrBufferFull) {
		buf := append([]byte(nil), line...)
		for errors.Is(err, bufio.ErrBufferFull) {
			if len(buf) > maxEventBytes {
				return nil, fmt.Errorf("sse line longer than %d bytes", maxEventBytes)
			}
			line, err = br.ReadSlice('\n')
			buf = append(buf, line...)
		}
		line = buf
	}
	if err != nil {
		// An unterminated last line is dropped, as an SSE parser must.
		return nil, err
	}
	line = line[:len(line)-1]
	if n := len(line); n > 0 && line[n-1] == '\r' {
		line = line[:n-1]
	}
	return line, nil
}

// readJSON reads a non-streaming response of the API.
func readJSON(ctx context.Context, api string, body io.Reader, res *Result) {
	b, err := io.ReadAll(io.LimitReader(body, 64<<20))
	if err != nil {
		res.Outcome, res.Detail = failureOutcome(ctx, err, OutcomeTruncated)
		return
	}
	res.TTFT, res.HasTTFT = time.Since(res.Start), true
	res.Events = 1
	if msg, ok := inBandError(b); ok {
		res.Outcome, res.Detail = OutcomeErrorEvent, msg
		return
	}
	finish, err := jsonFinish(api, b)
	if err != nil {
		res.Outcome, res.Detail = OutcomeTruncated, "invalid JSON body: "+err.Error()
		return
	}
	res.FinishReason = finish
	if res.FinishReason == "" {
		res.Outcome, res.Detail = OutcomeTruncated, "response has no finish_reason"
		return
	}
	res.Outcome = OutcomeOK
}

// failureOutcome names a failure: our own cancellation, a timeout, or the
// given fallback kind.
func failureOutcome(ctx context.Context, err error, fallback string) (string, string) {
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return OutcomeTimeout, err.Error()
	case ctx.Err() != nil:
		return OutcomeCancelled, err.Error()
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() || errors.Is(err, os.ErrDeadlineExceeded) {
		return OutcomeTimeout, err.Error()
	}
	return fallback, err.Error()
}

var (
	finishKey = []byte(`"finish_reason"`)
	errorKey  = []byte(`"error"`)
)

// finishReason returns the first non-null finish_reason in a chunk, without
// decoding the JSON unless the key is present with a string value.
func finishReason(d []byte) string {
	for rest := d; ; {
		i := bytes.Index(rest, finishKey)
		if i < 0 {
			return ""
		}
		rest = bytes.TrimLeft(rest[i+len(finishKey):], " \t")
		if len(rest) == 0 || rest[0] != ':' {
			continue
		}
		rest = bytes.TrimLeft(rest[1:], " \t")
		if len(rest) > 0 && rest[0] == '"' {
			if j := bytes.IndexByte(rest[1:], '"'); j > 0 {
				return string(rest[1 : 1+j])
			}
		}
	}
}

// inBandError reports whether a data payload is an error object, in
// OpenAI's shape {"error":{...}} or vLLM's {"object":"error",...}, and
// returns its message.
func inBandError(d []byte) (string, bool) {
	if !bytes.Contains(d, errorKey) {
		return "", false
	}
	var e struct {
		Error   json.RawMessage `json:"error"`
		Object  string          `json:"object"`
		Message string          `json:"message"`
	}
	if json.Unmarshal(d, &e) != nil {
		return "", false
	}
	if e.Object == "error" {
		return e.Message, true
	}
	if len(e.Error) == 0 || string(e.Error) == "null" {
		return "", false
	}
	var inner struct {
		Message string `json:"message"`
		Code    any    `json:"code"`
	}
	if json.Unmarshal(e.Error, &inner) == nil && inner.Message != "" {
		if inner.Code != nil {
			return fmt.Sprintf("%s (code %v)", inner.Message, inner.Code), true
		}
		return inner.Message, true
	}
	return string(e.Error), true
}

// errorCodeOf returns the "code" of an OpenAI error body, "" when none.
func errorCodeOf(b []byte) string {
	var e struct {
		Error struct {
			Code any `json:"code"`
		} `json:"error"`
	}
	if json.Unmarshal(b, &e) != nil || e.Error.Code == nil {
		return ""
	}
	return fmt.Sprint(e.Error.Code)
}

// errorMessage extracts a short message from an error response body.
func errorMessage(b []byte) string {
	if msg, ok := inBandError(b); ok {
		return msg
	}
	s := strings.TrimSpace(string(b))
	if len(s) > 200 {
		s = s[:200] + "…"
	}
	return s
}

// newHTTPClient returns a client for load generation: no environment proxy,
// no transparent compression (which would buffer the stream), no redirects
// (which could leave this machine), and enough idle connections to reuse one
// per concurrent stream.
func newHTTPClient(conns int) *http.Client {
	tr := &http.Transport{
		Proxy:                 nil,
		DialContext:           (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          conns + 16,
		MaxIdleConnsPerHost:   conns + 16,
		IdleConnTimeout:       90 * time.Second,
		DisableCompression:    true,
		ResponseHeaderTimeout: 0,
		ExpectContinueTimeout: 0,
	}
	return &http.Client{
		Transport: tr,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}

// chatBody builds an OpenAI chat completion request body.
func chatBody(model string, stream bool, maxTokens, promptBytes int) []byte {
	prompt := "Explain, briefly, why load balancers for LLM inference should look at time to first token."
	const filler = " The quick brown fox jumps over the lazy dog."
	var b strings.Builder
	b.WriteString(prompt)
	for b.Len() < promptBytes {
		b.WriteString(filler)
	}
	p := b.String()
	if promptBytes > 0 && len(p) > promptBytes {
		p = p[:promptBytes]
	}
	req := map[string]any{
		"model":    model,
		"messages": []map[string]string{{"role": "user", "content": p}},
		"stream":   stream,
	}
	if maxTokens > 0 {
		req["max_tokens"] = maxTokens
	}
	out, _ := json.Marshal(req)
	return out
}
