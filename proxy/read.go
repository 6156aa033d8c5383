package proxy

import (
	"context"
	"errors"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// read is step 1: the body into memory, bounded by max_request_body and
// charged to the body budget, and the parse of the few fields the gateway
// acts on. A body the llm_model matcher already read (a *Body in r.Body)
// is taken as it is, neither read nor charged again. It records why it
// could not go on (finish answers 400, 408, 413, or 503 when the body
// budget has no room) and reports whether to go on. The charge of a body
// read here is given back by finish, on every path; a matcher's body is
// given back when the request's context ends.
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
	body, fresh, err := bufferBody(x.ctx, x.r, BodyLimits{Limit: x.p.cfg.MaxRequestBody, Budget: x.p.cfg.BodyBudget, Clock: x.p.clock})
	if fresh {
		x.held = body // finish gives its charge back
	}
	if errors.Is(err, ErrBodyBudget) {
		x.refusal = &GatewayError{Status: http.StatusServiceUnavailable, Type: TypeServer,
			Code: "body_memory_exhausted", RetryAfter: 1,
			Message: "the gateway has no memory free for the request body now (max_buffered_bodies); retry shortly"}
		// Answered first, then the body read to nowhere (finish), so that a
		// client still sending it reads the 503 instead of a reset.
		x.discardAfter = http.NewResponseController(x.w).EnableFullDuplex() == nil
		return false
	}
	if err != nil && x.ctx.Err() != nil && errors.Is(err, context.Cause(x.ctx)) {
		// The request ended while it waited for the budget (client gone,
		// stream_timeout): answered as a wait for admission is.
		x.refusal = err
		return false
	}
	if err != nil {
		x.readErr, x.readGone = err, x.clientGone()
		return false
	}
	x.body = body.Bytes()
	if isJSONRequest(x.r) {
		info, err := body.Parse(x.api)
		if err != nil {
			x.jsonErr = err
			return false
		}
		x.result.Info = info
		if x.p.cfg.RequestUsage && x.api.InjectsUsage() && info.Stream && !info.IncludeUsage {
			// The upstream then reports the stream's real usage in a
			// usage-only chunk, which relay reads and keeps from the
			// client that did not ask for it. A read body keeps
			// usageSlack bytes of room, so the edit is made in place.
			if edited, ok := x.result.Info.SetIncludeUsage(x.body); ok {
				x.body, x.stripUsage = edited, true
			}
		}
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
// The buffer is sized once from a declared length (at most 256 KiB of it
// before the bytes arrive), else doubles as the body arrives. The returned
// slice is what every attempt sends, so all attempts carry an identical
// body. It charges no budget (the lifecycle's read does). Errors wrap
// ErrBodyTooLarge or the read error.
func ReadBody(r *http.Request, limit int64) ([]byte, error) {
	b, err := readBody(r.Context(), r, BodyLimits{Limit: limit})
	if err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// RequestInfo holds the few fields of a request body that the gateway acts
// on (api.Request: model, stream, output limit, n, prompt estimate).
type RequestInfo = api.Request

// ParseRequest parses a Chat Completions (or legacy Completions) request
// body: api.Chat.ParseRequest. Every other API is parsed by its own
// api.API.
func ParseRequest(body []byte) (RequestInfo, error) { return api.Chat.ParseRequest(body) }

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

// discardBody reads a refused request's body to nowhere (nothing is held),
// after its answer was written, for at most discardFor and MaxRequestBody
// bytes: the server closes a connection whose large body was left unread,
// and a client still writing it into the connection gets a broken pipe
// instead of the 503 it was sent.
func (x *exchange) discardBody() {
	rc := http.NewResponseController(x.w)
	if rc.SetReadDeadline(time.Now().Add(discardFor)) == nil {
		defer func() { _ = rc.SetReadDeadline(time.Time{}) }()
	}
	_, _ = io.Copy(io.Discard, io.LimitReader(x.r.Body, x.p.cfg.MaxRequestBody+1))
}

// discardFor bounds how long a refused body is read to nowhere.
const discardFor = 2 * time.Second
