package budget

import "time"

// Budget decides whether a retry, or a hedge, may be scheduled. Retries and
// hedges draw from the same budget, so together they cannot exceed its bound.
// Implementations are safe for concurrent use and allocate nothing.
type Budget interface {
	// Request records one original request (not a retry, not a hedge).
	// For a Ratio budget it earns retry capacity; a Bucket only counts it
	// for Stats.
	Request()
	// TryRetry asks for one retry (or hedge). When it returns true the
	// retry is charged at once, when it is scheduled and not when it
	// leaves backoff; it is not refunded if it never runs (the request was
	// cancelled during backoff, or another attempt won). When it returns
	// false the caller gives up and returns the failure it has.
	TryRetry() bool
	// Stats reports the budget's current state for metrics and the admin
	// API.
	Stats() Stats
}

// Stats is a snapshot of a budget, for metrics and the admin API.
type Stats struct {
	// Window is the span over which Requests and Retries are counted: the
	// Ratio's window, or DefaultWindow for a Bucket. The oldest of the
	// window's ten buckets may already be partly expired, so the counts
	// cover between 90% and 100% of Window.
	Window time.Duration
	// Requests is the number of original requests recorded in the window.
	Requests int
	// Retries is the number of retries and hedges granted in the window.
	Retries int
	// Available is the number of retries that would be granted if asked
	// for now, one after another, with no new requests (floored; ≥ 0).
	Available int
}

// Interface guards.
var (
	_ Budget = (*Ratio)(nil)
	_ Budget = (*Bucket)(nil)
)
