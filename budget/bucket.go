package budget

import (
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/rolling"
)

// Bucket is the token-bucket form of a retry budget (Caddyfile
// `bucket <max_tokens> <refill_per_sec>`, e.g. 10 and 0.5): it holds up to
// maxTokens tokens, starts full, and gains refillPerSec tokens per second,
// continuously, never beyond maxTokens. Each granted retry (or hedge) takes
// one whole token; original requests earn nothing.
//
// So a burst of up to maxTokens retries is allowed at once, and then
// refillPerSec per second, whatever the traffic. Over any run of length T
// starting when the bucket is created, retries granted are at most
//
//	maxTokens + refillPerSec × T
//
// exactly, under any interleaving of concurrent calls: the state is a single
// word (the time at which the bucket was, or will be, empty) changed by
// compare-and-swap, and the refill interval is rounded up to a whole
// nanosecond.
//
// This is the throttle of gRPC's retryThrottling (gRFC A6: maxTokens,
// tokenRatio) and of the AWS SDKs' retry quota (500 tokens, 5 per retry),
// with one difference: they refill on successful responses, which makes a
// fully failing service stop retrying and a healthy one never run dry; this
// bucket refills with time, so its rate does not depend on outcomes and the
// operator reads the bound straight off the configuration. Use Ratio when the
// allowance should follow traffic.
type Bucket struct {
	clock clock.Reader
	base  time.Time
	per   int64 // nanoseconds to earn one token: ⌈1e9 / refillPerSec⌉
	burst int64 // nanoseconds of credit when full: maxTokens × per
	max   float64
	rate  float64
	// empty is the time, in nanoseconds since base, at which the bucket
	// was or will be empty: the tokens at time t are
	// min(t − empty, burst) / per.
	empty atomic.Int64
	_     [56]byte
	stats struct {
		ep       clockEpochs
		requests rolling.Ring
		retries  rolling.Ring
	}
}

// NewBucket returns a token bucket, full, holding at most maxTokens tokens
// (at least 1) and gaining refillPerSec tokens per second (more than 0, at
// most 1e9). Tokens need not be whole: with maxTokens 2.5 the bucket grants
// 2 retries at once and keeps the half token toward the next one.
func NewBucket(maxTokens, refillPerSec float64, clk clock.Reader) (*Bucket, error) {
	if clk == nil {
		return nil, errors.New("retry bucket: nil clock")
	}
	if !(refillPerSec > 0 && refillPerSec <= 1e9) { // also refuses NaN
		return nil, fmt.Errorf("retry bucket: refill_per_sec %v: must be in (0, 1e9]", refillPerSec)
	}
	per := int64(math.Ceil(1e9 / refillPerSec))
	if !(maxTokens >= 1 && maxTokens*float64(per) < 1<<62) {
		return nil, fmt.Errorf("retry bucket: max_tokens %v: must be at least 1 and take less than 146 years to refill", maxTokens)
	}
	b := &Bucket{
		clock: clk,
		base:  clk.Now(),
		per:   per,
		burst: int64(maxTokens * float64(per)),
		max:   maxTokens,
		rate:  refillPerSec,
	}
	b.empty.Store(-b.burst)
	b.stats.ep = newClockEpochs(clk, DefaultWindow)
	return b, nil
}

// MaxTokens returns the bucket's capacity, in tokens (retries).
func (b *Bucket) MaxTokens() float64 { return b.max }

// RefillPerSec returns the bucket's refill rate, in tokens per second.
func (b *Bucket) RefillPerSec() float64 { return b.rate }

// now returns the clock's time in nanoseconds since base.
func (b *Bucket) now() int64 { return int64(b.clock.Now().Sub(b.base)) }

// Request counts an original request for Stats; it earns no token.
func (b *Bucket) Request() { b.stats.requests.Add(b.stats.ep.now()) }

// TryRetry takes one token and returns true, or returns false if the bucket
// holds less than one token.
func (b *Bucket) TryRetry() bool {
	now := b.now()
	for {
		e := b.empty.Load()
		from := max(e, now-b.burst) // a full bucket holds no more than burst
		if now-from < b.per {
			return false
		}
		if b.empty.CompareAndSwap(e, from+b.per) {
			b.stats.retries.Add(b.stats.ep.now())
			return true
		}
	}
}

// Stats reports the requests and retries of the last DefaultWindow and the
// whole tokens in the bucket.
func (b *Bucket) Stats() Stats {
	credit := min(b.now()-b.empty.Load(), b.burst)
	ep := b.stats.ep.now()
	return Stats{
		Window:    DefaultWindow,
		Requests:  int(b.stats.requests.Sum(ep)),
		Retries:   int(b.stats.retries.Sum(ep)),
		Available: int(max(0, credit/b.per)),
	}
}
