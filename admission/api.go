// Package admission decides, before any upstream is touched, who is
// admitted, who waits and who is refused (DESIGN §8): tenants and their
// tiers, per-tenant concurrency, request and token rate limits with token
// reservations settled by real usage, a pool's capacity with a bounded
// priority queue, and per-tenant circuit breakers. It is pure: it imports
// neither Caddy nor net/http, and takes a clock so its tests do not sleep.
//
// THIS FILE IS THE CONTRACT between admission and its users (proxy's
// identify/admit steps and the Caddy glue). Its exported names and
// signatures are fixed; the implementation fills in the bodies and may add
// unexported helpers and files.
package admission

import (
	"context"
	"crypto/sha256"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Defaults of Tier.
const (
	DefaultMaxTokens    = 1024             // Tier.DefaultMaxTokens
	DefaultQueue        = 100              // Tier.Queue and GateConfig.Queue
	DefaultQueueTimeout = 30 * time.Second // Tier.QueueTimeout
)

// Refusal codes: the "code" of a refusal's OpenAI error body and the
// "decision" label of caddy_llm_proxy_admission_total.
const (
	CodeTenantRPM           = "tenant_rpm"
	CodeTenantTPM           = "tenant_tpm"
	CodeTenantConcurrency   = "tenant_concurrency"
	CodeQueueFull           = "queue_full"
	CodeQueueTimeout        = "queue_timeout"
	CodeDisplaced           = "displaced"
	CodeSaturated           = "saturated"
	CodeTenantCircuitOpen   = "tenant_circuit_open"
	CodeRequestExceedsLimit = "request_exceeds_limit"
	CodeUnknownKey          = "invalid_api_key" // 401
	// CodeFleetUnavailable (503): a fail_closed tier's request while the
	// fleet's shared limits cannot be reached.
	CodeFleetUnavailable = "fleet_unavailable"
)

// Decisions that admitted a request (the other decisions are the codes).
const (
	DecisionAdmitted       = "admitted"
	DecisionQueuedAdmitted = "queued_admitted"
)

// UnknownTenant is the tenant id of requests admitted under Config.UnknownTier.
const UnknownTenant = "unknown"

// Tier is a class of tenants: a priority and the limits that apply to each
// of its tenants separately (every tenant has its own counters). Zero
// limits are not enforced.
type Tier struct {
	Name string
	// Priority orders the queue (higher first). Below 0 the tier is
	// sheddable: refused at once when the pool is saturated, never queued.
	Priority int
	// MaxConcurrent caps a tenant's requests in flight; 0 none.
	MaxConcurrent int
	// RPM caps a tenant's requests per rolling minute; 0 none.
	RPM int
	// TPM caps a tenant's tokens (reserved, then settled) per rolling
	// minute; 0 none.
	TPM int
	// DefaultMaxTokens is the completion reservation of a request that
	// names no max_tokens. Default DefaultMaxTokens.
	DefaultMaxTokens int
	// Queue caps how many of this tier's requests wait in a pool's queue;
	// default DefaultQueue (the pool's own bound still applies).
	Queue int
	// QueueTimeout bounds a queued request's wait. Default DefaultQueueTimeout.
	QueueTimeout time.Duration
	// TTFTSLO, when set, is the tenant breaker's objective for time to
	// first token: a request above TTFTSLO + TTFTPer1kPrompt × prompt
	// tokens / 1000 is a slow call.
	TTFTSLO         time.Duration
	TTFTPer1kPrompt time.Duration
	// QueueWaitSLO, when set, makes a queue wait above it a slow call.
	QueueWaitSLO time.Duration
	// FailClosed refuses the tier's requests with 503 (CodeFleetUnavailable)
	// and a Retry-After while the fleet's shared limits cannot be reached,
	// rather than admitting them on this gateway's share of the limits
	// (the default: fail open). It means nothing without a fleet store.
	FailClosed bool
	// Breaker holds the tenant breaker's thresholds (breaker.Settings:
	// consecutive failures, slow ratio, cooldowns...). nil: the tenant
	// breaker is off unless TTFTSLO or QueueWaitSLO is set, which turns
	// it on with breaker defaults.
	Breaker *breaker.Settings
}

// TenantConfig is one tenant's tier and per-tenant overrides (0 inherits
// the tier's value).
type TenantConfig struct {
	ID            string
	Tier          string
	MaxConcurrent int
	RPM           int
	TPM           int
}

// Config is the tenants-and-tiers configuration shared by every handler
// (the global llm_proxy option).
type Config struct {
	Tiers   []Tier
	Tenants []TenantConfig
	// DefaultTier is the tier of tenants named by a key or header but not
	// listed in Tenants. "" means the tier named "default" if one exists.
	DefaultTier string
	// UnknownTier admits requests with no key or an unknown key under
	// this tier (tenant UnknownTenant); "" refuses them with 401.
	UnknownTier string
}

// Validate checks cfg (unknown tier names, negative limits, duplicate
// names), returning an error that names the offending field.
func (cfg Config) Validate() error { return cfg.validate() }

// Key is one API key's hash and whom it names.
type Key struct {
	// Hash is sha256 of the key as the client sends it.
	Hash [32]byte
	// Tenant is the tenant id; Tier, when set, overrides the tenant's tier.
	Tenant, Tier string
}

// HashKey returns sha256 of key.
func HashKey(key string) [32]byte { return sha256.Sum256(keyBytes(key)) }

// Directory maps API keys to tenants. Keys are held hashed only; a lookup
// hashes the presented key and compares in constant time. Safe for
// concurrent use; immutable once built.
type Directory struct {
	idx  map[uint64]int32 // first 8 bytes of a hash → its chain in ents
	ents []dirEntry
}

// NewDirectory builds a directory; two keys with the same hash is an error.
func NewDirectory(keys []Key) (*Directory, error) { return newDirectory(keys) }

// Lookup returns the tenant and tier of a presented key ("" tier: the
// tenant's own), ok false when the key is unknown. It allocates nothing.
func (d *Directory) Lookup(key string) (tenant, tier string, ok bool) { return d.lookup(key) }

// Len returns the number of keys.
func (d *Directory) Len() int {
	if d == nil {
		return 0
	}
	return len(d.ents)
}

// Observer receives admission's measurements (metrics). Labels: tier, and
// tenant only when the operator enables it (the glue decides).
type Observer interface {
	// Decision is called once per request with DecisionAdmitted,
	// DecisionQueuedAdmitted or a refusal code.
	Decision(tenant, tier, decision string)
	// QueueWait reports the time an admitted or refused request waited.
	QueueWait(tenant, tier string, d time.Duration)
	// QueueDepth reports the number of a tier's requests waiting in a gate.
	QueueDepth(tier string, n int)
	// Inflight reports the number of a tier's admitted requests running.
	Inflight(tier string, n int)
	// Tokens reports settled tokens: api is the request's API as the
	// settlement named it (Usage.API: "chat", "responses", "messages",
	// ...), kind "prompt" or "completion", source "usage" or "estimate".
	Tokens(tenant, tier, api, kind, source string, n int)
	// TenantBreaker reports a tenant breaker transition.
	TenantBreaker(tenant, tier string, tr breaker.Transition)
}

// Request is what admission needs to know of a request.
type Request struct {
	// Tenant and Tier identify the caller (Tier "" = the tenant's own).
	Tenant, Tier string
	// PromptTokens is the prompt estimate: ⌈characters of all text
	// content ÷ 4⌉.
	PromptTokens int
	// MaxTokens is the request's max_completion_tokens, else max_tokens;
	// 0 when it named neither (the tier's DefaultMaxTokens applies).
	MaxTokens int
	// N is the number of choices (n); 0 means 1.
	N int
}

// Limit describes one rate limit for OpenAI's x-ratelimit-* headers.
type Limit struct {
	// Limit is the configured value (rpm or tpm).
	Limit int
	// Remaining is what is left now, this request's reservation counted,
	// never below 0.
	Remaining int
	// Reset is the time until the limit is fully available again.
	Reset time.Duration
}

// Limits are the rate limits of a tenant; nil for a limit it does not have.
type Limits struct {
	Requests *Limit // rpm
	Tokens   *Limit // tpm
}

// Refusal is admission's "no". It implements error.
type Refusal struct {
	// Status is the HTTP status: 429 (tenant limits, queue backpressure,
	// open tenant breaker), 503 (no capacity can ever serve; a fail_closed
	// tier while the fleet's limits are unreachable), 401.
	Status int
	// Code is one of the Code* constants.
	Code string
	// Message names the limit that was hit, its value and its window.
	Message string
	// RetryAfter is when waiting helps (0: it never will, e.g.
	// CodeRequestExceedsLimit, or 401).
	RetryAfter time.Duration
	// CircuitOpen is set for CodeTenantCircuitOpen (X-Circuit-Breaker: open).
	CircuitOpen bool
	// Limits are the tenant's rate limits, for x-ratelimit-* headers.
	Limits Limits
}

func (r *Refusal) Error() string { return r.Message }

// Verdict is what a finished request says about its tenant (DESIGN §4,
// tenant column), decided by the lifecycle's finish step.
type Verdict uint8

const (
	// VerdictNeutral: says nothing of the tenant (upstream failures,
	// client gone, hedge losers, config unloaded).
	VerdictNeutral Verdict = iota
	// VerdictSuccess: served within its objectives.
	VerdictSuccess
	// VerdictFailure: the tenant's own fault (a 4xx it caused, e.g.
	// context too long).
	VerdictFailure
)

// Usage is what a finished request really used and how it went, for
// settlement and the tenant breaker.
type Usage struct {
	PromptTokens, CompletionTokens int
	// Estimated is true when the upstream reported no usage (the counts
	// are the prompt estimate and the completion tokens counted).
	Estimated bool
	Verdict   Verdict
	// API names the request's API ("chat", "responses", "messages", ...),
	// passed to Observer.Tokens as a label; "" when unknown.
	API string
	// TTFT is time to first token of the committed attempt (0: none).
	TTFT time.Duration
}

// Controller holds every tenant's counters and breaker. It is shared by
// every handler of the process and survives reloads (SetConfig applies a
// new config to existing state). Safe for concurrent use.
type Controller struct{ controllerState }

// NewController returns a controller for cfg (validated).
func NewController(cfg Config, clk clock.Clock, obs Observer) (*Controller, error) {
	return newController(cfg, clk, obs)
}

// SetConfig applies a new config; tenants' windows and breakers are kept.
func (c *Controller) SetConfig(cfg Config) error { return c.setConfig(cfg) }

// Tier returns the effective tier of a tenant (Request.Tier if set, else
// its configured tier, else the default), ok false when it names none.
func (c *Controller) Tier(tenant, tier string) (Tier, bool) { return c.tier(tenant, tier) }

// Reserve applies the tenant's own limits and breaker: open tenant breaker,
// max_concurrent, rpm, tpm (reservation = PromptTokens + N × (MaxTokens, or
// the tier's DefaultMaxTokens capped at what is left of the tpm limit; an
// explicit MaxTokens is reserved in full). A refusal consumes nothing. The
// Ticket must be settled exactly once.
func (c *Controller) Reserve(req Request) (*Ticket, *Refusal) {
	tk := new(Ticket)
	if r := c.reserve(tk, &req); r != nil {
		return nil, r
	}
	return tk, nil
}

// ReserveInto is Reserve into a Ticket the caller provides (and may embed
// in its own per-request state), so that admission allocates nothing per
// admitted request; Reserve allocates the Ticket (one allocation). tk must
// be a zero Ticket, or one that is settled and no longer used by anyone:
// reusing a ticket that another goroutine may still settle or read is the
// caller's bug. On a refusal tk is left unusable (Settle does nothing).
func (c *Controller) ReserveInto(tk *Ticket, req Request) *Refusal {
	tk.t = nil
	return c.reserve(tk, &req)
}

// Ticket is an admitted request's hold on its tenant's limits.
//
// A Ticket must not be copied (go vet checks).
type Ticket struct{ ticketState }

// Limits returns the tenant's rate limits with this request counted.
func (t *Ticket) Limits() Limits { return t.limits }

// Tenant and Tier return whom the ticket charges.
func (t *Ticket) Tenant() string { return t.t.id }

// Tier is the request's effective tier, defaults applied and the tenant's
// overrides (MaxConcurrent, RPM, TPM) in place of the tier's own.
func (t *Ticket) Tier() Tier { return t.ti.effective(t.lim) }

// Reserved returns the tokens reserved.
func (t *Ticket) Reserved() int { return int(t.reserved) }

// Settle replaces the reservation with what was used, gives back the
// concurrency slot and records the verdict on the tenant breaker (with the
// slow-call rule: TTFT or queue wait above the tier's objectives). It runs
// exactly once; later calls do nothing.
func (t *Ticket) Settle(u Usage, queueWait time.Duration) { t.settle(&u, queueWait) }

// Cancel gives back everything the ticket took — concurrency slot, rpm
// count, token reservation — as if the request had never been admitted (it
// was refused later, e.g. by a pool's queue: a refused request consumes
// nothing). It records nothing on the tenant breaker and reports no tokens.
// Cancel or Settle runs once; whichever comes first wins.
func (t *Ticket) Cancel() { t.cancel() }

// GateConfig configures a pool's capacity and queue.
type GateConfig struct {
	// Capacity returns the pool's in-flight capacity now (a fixed n, or
	// per_upstream n × upstreams whose breaker is closed); <= 0 means
	// unlimited.
	Capacity func() int
	// Saturated is the pool signal: true while every healthy upstream is
	// at its saturation threshold (upstream.Pool.Saturated). A saturated
	// pool is treated like a full Capacity, even an unlimited one:
	// sheddable tiers are refused (CodeSaturated), the others queue by
	// priority. nil means never saturated. It is consulted wherever the
	// gate decides whether a slot is free (Acquire, release, queue
	// timeout, Saturated), so the glue calls Saturated when the signal
	// may have cleared (after each scrape) and the queue's head is
	// admitted at once. It must be cheap and allocation-free.
	Saturated func() bool
	// Queue bounds the requests waiting; default DefaultQueue.
	Queue int
	// Controller, when set, is told of each tenant's queued requests, so
	// that Controller.Tenants shows them.
	Controller *Controller
}

// Gate is one pool's capacity with a priority queue: work-conserving (a
// lower tier uses what higher tiers leave idle); when saturated, sheddable
// tiers are refused at once and the others wait by priority then arrival,
// up to their tier's QueueTimeout; a higher-priority arrival at a full
// queue displaces the newest queued request of a lower tier. Safe for
// concurrent use.
//
// Capacity and the pool signal are re-read on every Acquire, release and
// queue timeout, and on every Saturated call: when capacity grows or the
// pool signal clears without any of these (upstreams recover, a scrape
// shows the queues drained), the glue calls Saturated (e.g. from its
// upstream breaker listener and after each scrape) and the queue's head is
// admitted at once.
type Gate struct{ gateState }

// NewGate returns a gate.
//
// Observer calls: Decision and QueueWait once per Acquire (none for a
// client that left the queue), from the acquiring goroutine; QueueDepth and
// Inflight on every change, with the gate's lock held so that each gauge's
// values arrive in order (they must not call the gate). Each admitted
// Acquire allocates its release func; queued ones their waiter.
func NewGate(cfg GateConfig, clk clock.Clock, obs Observer) *Gate { return newGate(cfg, clk, obs) }

// Acquire takes a slot for a request of tier, waiting in the queue while
// the pool is saturated. It returns the time waited and a release func to
// call exactly once when the request ends, or a refusal (CodeSaturated,
// CodeQueueFull, CodeQueueTimeout, CodeDisplaced). A request whose ctx ends
// while queued leaves the queue at once (ctx.Err() is returned as the
// error, not a Refusal). An expired queued request is never admitted.
//
// Admission is immediate when a slot is free (no one waits then: every
// release admits the queue's head). Otherwise a sheddable tier (Priority <
// 0) is refused at once (CodeSaturated); another waits if its tier's share
// (Tier.Queue) and the pool's queue have room; at a full pool queue it
// displaces the newest request of the lowest tier below it (CodeDisplaced
// to that one), else it is refused (CodeQueueFull). A queued request
// is refused with CodeQueueTimeout once it has waited its tier's QueueTimeout.
// Every refusal is a *Refusal with Status 429 and a Retry-After of 1s.
// Tier's zero Queue and QueueTimeout take their defaults.
func (g *Gate) Acquire(ctx context.Context, tenant string, tier Tier) (release func(), waited time.Duration, err error) {
	return g.acquire(ctx, tenant, tier)
}

// Saturated reports whether the pool is at capacity, or saturated by its
// pool signal (GateConfig.Saturated), now. It first admits queued requests
// for which capacity has grown or the signal has cleared.
func (g *Gate) Saturated() bool { return g.saturated() }

// Pump admits the queued requests for which a slot is free now: call it
// when the capacity may have grown or the pool signal cleared without an
// Acquire, release or queue timeout (the pool's breakers closed, a scrape
// showed its queues drained).
func (g *Gate) Pump() { g.saturated() }

// TenantView is one tenant's state for the admin API (no keys).
type TenantView struct {
	Tenant   string `json:"tenant"`
	Tier     string `json:"tier"`
	Inflight int    `json:"inflight"`
	Queued   int    `json:"queued"`
	// RequestsInWindow and TokensInWindow are the rolling minute's usage.
	RequestsInWindow int `json:"requests_in_window"`
	TokensInWindow   int `json:"tokens_in_window"`
	// Limits are the tenant's effective limits (0: none).
	MaxConcurrent int `json:"max_concurrent,omitempty"`
	RPM           int `json:"rpm,omitempty"`
	TPM           int `json:"tpm,omitempty"`
	// Breaker is the tenant breaker's state, nil when it has none.
	Breaker *breaker.Snapshot `json:"breaker,omitempty"`
}

// Tenants returns every tenant with state, sorted by id.
func (c *Controller) Tenants() []TenantView { return c.tenantViews() }

// TenantBreaker returns a tenant's breaker (nil if none), for the admin
// API's open/close/reset.
func (c *Controller) TenantBreaker(tenant string) *breaker.Breaker { return c.tenantBreaker(tenant) }
