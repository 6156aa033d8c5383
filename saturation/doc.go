// Package saturation is the gateway's view of each inference server's load
// (DESIGN §7): the /metrics scraper, the signals, the scores and the
// saturation trips.
//
//   - Signals (signals.go): the names of a server's /metrics series per
//     server kind (vLLM, SGLang, TGI), the parse of one scrape into a
//     Sample per server and per model, with staleness, and the quantiles
//     of histogram deltas between two scrapes; the server's own
//     prefix-cache hit ratio (prefixhits.go).
//   - Config (config.go): Saturation, the scrape interval, timeout,
//     staleness, thresholds and trip rules with their defaults and
//     validation, and the Signal and SignalState labels of metrics and
//     the admin API.
//   - Scraper (scrape.go): one per upstream server, owned by package
//     upstream's entry for that address and shared by every handler and
//     config that reads it. Its loop scrapes at once, then every interval,
//     one scrape at a time, each bounded by its timeout; Apply publishes
//     a scrape as a snapshot that the request path reads with one atomic
//     load, reports signals to an Observer, and runs the saturation
//     breaker over the breakers its Host names (the pools that configured
//     saturation: a verdict steers no other pool).
//   - Score (score.go): an upstream's score from its latest snapshot and
//     the attempts started since it (1 is saturated; unknown is never
//     idle, never full), and the admin API's View.
//   - Trip rules (trip.go): TripMonitor, how long each rule has held, and
//     Verdict, one scrape's observation for a tripped breaker.
//
// It is pure Go but for the HTTP round trip of a scrape (the config's
// Transport): time comes from an injected Clock (the scrape interval, the
// scrape timeout and the stamps), so its tests and package upstream's run
// on a fake clock without sleeping. It imports breaker (the breakers it
// trips) and internal/clock, and nothing else of the module. Package
// upstream ranks and filters candidates by the scores and sums them into the pool signal.
package saturation
