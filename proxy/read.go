package proxy

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// read is step 1: the body into memory, bounded by max_request_body, and
// the parse of the few fields the gateway acts on. It records why it could
// not go on (finish answers 400, 408 or 413) and reports whether to go on.
func (x *exchange) read() bool {
	if d := x.p.cfg.StreamTimeout; d > 0 {
		// stream_timeout runs from the request's arrival: a body that
		// trickles in must not hold the request past it. A connection
		// deadline is wall-clock time, whatever the proxy's Clock.
		rc := http.NewResponseController(x.w)
		if rc.SetReadDeadline(time.Now().Add(d-x.since(x.start))) == nil {
			defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
		}
	}
	body, err := ReadBody(x.r, x.p.cfg.MaxRequestBody)
	if err != nil {
		x.readErr, x.readGone = err, x.clientGone()
		return false
	}
	x.body = body
	if isJSONRequest(x.r) {
		info, err := ParseRequest(body)
		if err != nil {
			x.jsonErr = err
			return false
		}
		x.res.Info = info
	}
	return true
}

// DefaultMaxRequestBody is the request body limit when none is configured:
// 16 MiB holds a 128K-token prompt with room to spare.
const DefaultMaxRequestBody int64 = 16 << 20

// ErrBodyTooLarge is returned by ReadBody when the body exceeds the limit.
var ErrBodyTooLarge = errors.New("request body too large")

// ReadBody reads r's body into memory, refusing more than limit bytes. A
// declared Content-Length over the limit is refused without reading a byte.
// The returned slice is what every attempt sends, so all attempts carry an
// identical body. Errors wrap ErrBodyTooLarge or the read error.
func ReadBody(r *http.Request, limit int64) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	if r.ContentLength > limit {
		return nil, fmt.Errorf("%w: declared %d bytes, limit %d", ErrBodyTooLarge, r.ContentLength, limit)
	}
	// Start from the declared length, but not more than 64 KiB: a client
	// that declares 16 MiB and sends a byte must not cost 16 MiB.
	size := 512
	if r.ContentLength > 0 {
		size = int(min(r.ContentLength, 64<<10))
	}
	buf := make([]byte, 0, size+1)
	for {
		if int64(len(buf)) > limit {
			return nil, fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, limit)
		}
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := r.Body.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		if err == io.EOF {
			if int64(len(buf)) > limit {
				return nil, fmt.Errorf("%w: more than %d bytes", ErrBodyTooLarge, limit)
			}
			return buf, nil
		}
		if err != nil {
			return nil, fmt.Errorf("reading request body: %w", err)
		}
	}
}

// RequestInfo holds the few fields of an OpenAI-style request body that the
// gateway acts on. Everything else passes through untouched.
type RequestInfo struct {
	// Model is the "model" field, "" when absent.
	Model string
	// Stream is the "stream" field.
	Stream bool
	// MaxTokens is max_completion_tokens, else max_tokens; 0 when absent.
	MaxTokens int
	// IncludeUsage is stream_options.include_usage.
	IncludeUsage bool
}

// requestFields mirrors the JSON we read; unknown fields are ignored.
type requestFields struct {
	Model               string `json:"model"`
	Stream              bool   `json:"stream"`
	MaxTokens           *int   `json:"max_tokens"`
	MaxCompletionTokens *int   `json:"max_completion_tokens"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// ParseRequest validates body as one JSON object and extracts RequestInfo.
// An empty body yields a zero RequestInfo. Invalid JSON, a non-object, or a
// listed field of the wrong type is an error suitable for a 400 response.
func ParseRequest(body []byte) (RequestInfo, error) {
	var info RequestInfo
	if len(body) == 0 {
		return info, nil
	}
	var f requestFields
	if err := json.Unmarshal(body, &f); err != nil {
		return info, fmt.Errorf("invalid JSON body: %w", err)
	}
	// json.Unmarshal accepts "null" into a struct; a request must be an object.
	if first := firstNonSpace(body); first != '{' {
		return info, errors.New("invalid JSON body: expected a JSON object")
	}
	info.Model = f.Model
	info.Stream = f.Stream
	switch {
	case f.MaxCompletionTokens != nil:
		info.MaxTokens = *f.MaxCompletionTokens
	case f.MaxTokens != nil:
		info.MaxTokens = *f.MaxTokens
	}
	if info.MaxTokens < 0 {
		return RequestInfo{}, fmt.Errorf("invalid max_tokens %d: must not be negative", info.MaxTokens)
	}
	info.IncludeUsage = f.StreamOptions != nil && f.StreamOptions.IncludeUsage
	return info, nil
}

func firstNonSpace(b []byte) byte {
	for _, c := range b {
		switch c {
		case ' ', '\t', '\r', '\n':
			continue
		}
		return c
	}
	return 0
}

// isJSONRequest reports whether the request body should be parsed as JSON:
// OpenAI's completion endpoints take JSON whatever the client labels it
// (curl -d sends application/x-www-form-urlencoded), so every body is
// parsed except uploads: multipart forms (audio transcription, files) and
// raw binary or media types, which pass through unparsed.
func isJSONRequest(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return true
	}
	ct = strings.ToLower(strings.TrimSpace(strings.SplitN(ct, ";", 2)[0]))
	switch {
	case strings.HasPrefix(ct, "multipart/"), ct == "application/octet-stream",
		strings.HasPrefix(ct, "audio/"), strings.HasPrefix(ct, "image/"), strings.HasPrefix(ct, "video/"):
		return false
	}
	return true
}
