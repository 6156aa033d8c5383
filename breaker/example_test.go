package breaker_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// The gateway's attempt: the permit is released by a deferred closure on
// every path; the outcome stays Neutral unless the attempt got far enough
// to say something about the upstream.
func Example() {
	b := breaker.New("10.0.0.2:8000", breaker.Settings{SlowTTFT: 10 * time.Second})

	attempt := func(upstream func() (time.Duration, error)) error {
		p, ok := b.Allow()
		if !ok {
			return fmt.Errorf("upstream %s: breaker %s until %v", b.Key(), b.State(), b.RetryAt())
		}
		outcome, ttft, reason := breaker.Neutral, time.Duration(0), "gateway panic"
		defer func() { p.Done(outcome, ttft, reason) }()

		ttft, err := upstream()
		switch {
		case errors.Is(err, errClientGone):
			outcome = breaker.Neutral
		case err != nil:
			outcome, reason = breaker.Failure, err.Error()
		default:
			outcome = breaker.Success // slow if ttft > SlowTTFT
		}
		return err
	}

	for range 3 {
		_ = attempt(func() (time.Duration, error) { return 0, errors.New("http 502") })
	}
	fmt.Println(b.State(), b.Snapshot().LastFailure)
	// Output: open http 502
}

var errClientGone = errors.New("client gone")
