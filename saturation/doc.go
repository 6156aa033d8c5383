// Package saturation reads an inference server's load signals (DESIGN §7):
// the names of its /metrics series per server kind (vLLM, SGLang, TGI),
// the parse of one scrape into a Sample per server and per model, with
// staleness, and the quantiles of histogram deltas between two scrapes;
// and the Saturation config (scrape interval, thresholds, trip rules,
// with their defaults) with the Signal and SignalState labels of metrics
// and the admin API; and the saturation breaker's trip rules (TripMonitor:
// how long each rule has held; Verdict: one scrape's observation for a
// tripped breaker). It is pure Go: no goroutines, no timers, no I/O
// beyond the io.Reader it is given; times are passed in. Package upstream
// scrapes, scores and trips breakers with it (the scrape loop and the
// score still live in upstream, on its entries and pools).
package saturation
