package mockllm

import (
	"maps"
	"net/http"
	"strings"
	"time"
)

// historyLimit bounds ReplicaStats.BodySHA256 and ReplicaStats.Recent.
const historyLimit = 1000

// Outcomes of a request, as RequestRecord.Outcome reports them; a fault
// that ended the request is reported as "fault:<kind>".
const (
	OutcomeInFlight       = "in_flight"
	OutcomeCompleted      = "completed"
	OutcomeCancelled      = "cancelled"
	OutcomeInvalidRequest = "invalid_request"
)

// FleetStats is the JSON of GET /mock/stats.
type FleetStats struct {
	Replicas []ReplicaStats `json:"replicas"`
}

// ReplicaStats counts what one replica saw since it started or since its
// last reset. Only completion requests (/v1/chat/completions,
// /v1/completions, /v1/responses, /v1/messages) are counted, except
// HealthChecks and the scrape counts.
type ReplicaStats struct {
	// Index is the replica's position in the fleet, from 0.
	Index int `json:"index"`
	// Addr is the replica's "host:port".
	Addr string `json:"addr"`
	// Behavior is the replica's current Behavior as a spec string.
	Behavior string `json:"behavior"`
	// Requests counts completion requests received.
	Requests int64 `json:"requests"`
	// Completed counts requests answered in full.
	Completed int64 `json:"completed"`
	// Cancelled counts requests whose client went away before the
	// response was finished (including hang faults ended by the client).
	Cancelled int64 `json:"cancelled"`
	// Faults counts injected faults by kind ("status", "cut", ...).
	Faults map[string]int64 `json:"faults"`
	// InFlight is the number of requests being handled now (waiting,
	// generating or hanging).
	InFlight int `json:"in_flight"`
	// MaxInFlight is the largest InFlight seen since the replica started
	// or since its last reset (which starts it at the InFlight of that
	// moment): the most completion requests it handled at once.
	MaxInFlight int `json:"max_in_flight"`
	// Running is the number of requests holding a generation slot.
	Running int `json:"running"`
	// Waiting is the number of requests queued for a slot.
	Waiting int `json:"waiting"`
	// KVBlocks is the size of the KV cache in blocks; KVBlocksUsed the
	// blocks held by running requests now (above KVBlocks when their
	// growth overcommits the cache).
	KVBlocks     int `json:"kv_blocks"`
	KVBlocksUsed int `json:"kv_blocks_used"`
	// HealthChecks counts GET /health requests.
	HealthChecks int64 `json:"health_checks"`
	// Metrics is the replica's MetricsMode as a spec string ("normal",
	// "frozen,kv=old", ...).
	Metrics string `json:"metrics"`
	// Scrapes counts GET /metrics requests received, whatever the
	// MetricsMode made of them.
	Scrapes int64 `json:"scrapes"`
	// ScrapesInFlight is the number of GET /metrics requests being
	// answered now (hanging and slow ones included).
	ScrapesInFlight int `json:"scrapes_in_flight"`
	// MaxConcurrentScrapes is the largest ScrapesInFlight seen since the
	// replica started or since its last reset (which starts it at the
	// ScrapesInFlight of that moment).
	MaxConcurrentScrapes int `json:"max_concurrent_scrapes"`
	// IdleDrops counts requests dropped unanswered because they arrived on
	// a keep-alive connection the server was closing as idle
	// (FleetConfig.IdleCloseRace). They are not counted in Requests.
	IdleDrops int64 `json:"idle_drops"`
	// BodySHA256 is the hex SHA-256 of each request body, in arrival
	// order, the last 1000.
	BodySHA256 []string `json:"body_sha256"`
	// Recent describes the last 1000 requests, in arrival order.
	Recent []RequestRecord `json:"recent"`
	// LastBody is the body of the last completion request received (as
	// the replica read it, byte for byte), nil when none was since the
	// start or the last reset. Only the last is kept, so memory stays
	// bounded whatever the bodies' size.
	LastBody []byte `json:"last_body,omitempty"`
	// LastHeaders are the headers of that request, as RequestRecord.Headers
	// holds them (lowercase names, no credentials).
	LastHeaders map[string]string `json:"last_headers,omitempty"`
}

// RequestRecord describes one completion request.
type RequestRecord struct {
	// ID is the response id ("chatcmpl-…", "cmpl-…"); vLLM-like, it
	// follows the X-Request-Id request header when there is one.
	ID   string `json:"id"`
	Path string `json:"path"`
	// API is the API of the request's path (chat, completions, responses,
	// messages).
	API API `json:"api"`
	// Model and Stream are read from the request body.
	Model  string `json:"model,omitempty"`
	Stream bool   `json:"stream"`
	// Started is when the request was received; FirstEvent when its first
	// token was sent (streaming) or generated (non-streaming); Ended when
	// the response was finished, the fault struck, or the client was seen
	// going away (within a millisecond or so).
	Started    time.Time `json:"started"`
	FirstEvent time.Time `json:"first_event,omitzero"`
	Ended      time.Time `json:"ended,omitzero"`
	// Outcome is in_flight, completed, cancelled, invalid_request or
	// fault:<kind>.
	Outcome string `json:"outcome"`
	// Fault is the kind of fault injected, if any (also set for a hang
	// whose outcome is cancelled).
	Fault string `json:"fault,omitempty"`
	// Status is the HTTP status sent, 0 when none was.
	Status int `json:"status,omitempty"`
	// EventsSent counts SSE data events written (role, tokens, usage,
	// error, [DONE]); TokensSent counts token events only.
	EventsSent int `json:"events_sent"`
	TokensSent int `json:"tokens_sent"`
	// BodySHA256 is the hex SHA-256 of the request body.
	BodySHA256 string `json:"body_sha256"`
	// XForwardedFor is the X-Forwarded-For request header.
	XForwardedFor string `json:"x_forwarded_for,omitempty"`
	// Authorization reports whether an Authorization header was present
	// (its value is never recorded).
	Authorization bool `json:"authorization"`
	// APIKey reports whether an x-api-key header (Anthropic's credential)
	// was present (its value is never recorded).
	APIKey bool `json:"api_key"`
	// Headers holds the other request headers (lowercase names, values
	// joined by ", "), without Authorization, Cookie and
	// Proxy-Authorization.
	Headers map[string]string `json:"headers,omitempty"`
	// Usage is the usage the replica reported to the client: in the
	// non-streaming body, or in the usage chunk of a stream that asked for
	// it (stream_options.include_usage), response.completed /
	// response.incomplete (Responses) or the last message_delta
	// (Messages); nil when it sent none. Messages and Responses report
	// PromptTokens as input_tokens and CompletionTokens as output_tokens.
	Usage *Usage `json:"usage,omitempty"`
}

// Usage is the token usage a replica reported for one request.
type Usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// ring keeps the last historyLimit items.
type ring[T any] struct{ items []T }

func (r *ring[T]) add(v T) {
	if len(r.items) == historyLimit {
		copy(r.items, r.items[1:])
		r.items = r.items[:historyLimit-1]
	}
	r.items = append(r.items, v)
}

// counters is the resettable part of a replica's statistics, guarded by
// Replica.mu.
type counters struct {
	gen          uint64 // bumped by a reset; records of older generations are not counted
	seq          int64  // completion requests since the reset (drives Fault.Every)
	requests     int64
	completed    int64
	cancelled    int64
	healthChecks int64
	idleDrops    int64
	scrapes      int64
	maxScrapes   int // maximum concurrent GET /metrics
	maxInFlight  int
	faults       map[string]int64
	bodies       ring[string]
	recent       ring[*RequestRecord]
	lastBody     []byte
}

func (c *counters) reset() {
	*c = counters{gen: c.gen + 1, faults: map[string]int64{}}
}

func (c *counters) snapshot() ReplicaStats {
	s := ReplicaStats{
		Requests:             c.requests,
		Completed:            c.completed,
		Cancelled:            c.cancelled,
		HealthChecks:         c.healthChecks,
		IdleDrops:            c.idleDrops,
		MaxInFlight:          c.maxInFlight,
		Scrapes:              c.scrapes,
		MaxConcurrentScrapes: c.maxScrapes,
		Faults:               maps.Clone(c.faults),
		BodySHA256:           append([]string{}, c.bodies.items...),
		Recent:               make([]RequestRecord, len(c.recent.items)),
		LastBody:             c.lastBody,
	}
	for i, r := range c.recent.items {
		s.Recent[i] = *r
		s.Recent[i].Headers = maps.Clone(r.Headers)
		if r.Usage != nil {
			u := *r.Usage
			s.Recent[i].Usage = &u
		}
	}
	if n := len(s.Recent); n > 0 && c.lastBody != nil {
		s.LastHeaders = maps.Clone(s.Recent[n-1].Headers)
	}
	return s
}

// headersOfInterest copies request headers into a record, leaving out
// credentials.
func headersOfInterest(rec *RequestRecord, h http.Header) {
	rec.Authorization = h.Get("Authorization") != ""
	rec.APIKey = h.Get("X-Api-Key") != ""
	rec.XForwardedFor = h.Get("X-Forwarded-For")
	rec.Headers = make(map[string]string, len(h))
	for k, v := range h {
		switch lk := strings.ToLower(k); lk {
		case "authorization", "cookie", "proxy-authorization", "x-api-key":
		default:
			rec.Headers[lk] = strings.Join(v, ", ")
		}
	}
}
