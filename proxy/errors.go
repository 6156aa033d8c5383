package proxy

import (
	"net/http"
	"strconv"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/api"
)

// Error types used in gateway-written bodies. They follow OpenAI's names so
// that SDKs map them to their typed errors.
const (
	TypeInvalidRequest = "invalid_request_error"
	TypeServer         = "server_error"
	TypeRateLimit      = "rate_limit_error"
	TypeTimeout        = "timeout_error"
)

// GatewayError is a response the gateway writes itself, before commit. It
// is also an error, so that an Identifier or Admitter can refuse with it.
type GatewayError struct {
	// Status is the HTTP status code.
	Status int
	// Message, Type and Code fill OpenAI's error envelope.
	Message, Type, Code string
	// RetryAfter, when positive, is sent as Retry-After in whole seconds.
	RetryAfter int
	// Header holds extra response headers (e.g. X-Circuit-Breaker).
	Header http.Header
}

// Error returns the status, code and message.
func (e *GatewayError) Error() string {
	return strconv.Itoa(e.Status) + " " + e.Code + ": " + e.Message
}

// Write sends e as an application/json response in OpenAI's error shape.
func (e *GatewayError) Write(w http.ResponseWriter) { e.WriteFor(w, api.Chat) }

// WriteFor sends e as an application/json response in the error shape of
// the request's API a (Anthropic's on Messages, OpenAI's otherwise, see
// api.API.AppendErrorBody), with its headers; on Messages the
// x-ratelimit-* headers get their anthropic-ratelimit-* forms beside them.
func (e *GatewayError) WriteFor(w http.ResponseWriter, a api.API) {
	h := w.Header()
	for k, v := range e.Header {
		h[k] = v
	}
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	if e.RetryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(e.RetryAfter))
	}
	if a == api.Messages {
		setAnthropicRateLimitHeaders(h, time.Now())
	}
	body := a.AppendErrorBody(nil, api.Error{Status: e.Status, Type: e.Type, Code: e.Code, Message: e.Message})
	body = append(body, '\n')
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(e.Status)
	_, _ = w.Write(body)
}
