// Package saturation reads an inference server's load signals (DESIGN §7):
// the names of its /metrics series per server kind (vLLM, SGLang, TGI),
// the parse of one scrape into a Sample per server and per model, with
// staleness, and the quantiles of histogram deltas between two scrapes;
// and the Saturation config (scrape interval, thresholds, trip rules,
// with their defaults) with the Signal and SignalState labels of metrics
// and the admin API. It is pure Go: no goroutines, no timers, no I/O
// beyond the io.Reader it is given; times are passed in. Package upstream
// scrapes, scores and trips breakers with it (the scrape loop, score and
// trip rules still live in upstream).
package saturation
