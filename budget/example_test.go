package budget_test

import (
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/budget"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock/clocktest"
)

// The attempt loop's use of a budget and a backoff: record the request,
// and after a retryable failure ask the budget, then wait.
func Example() {
	retries, _ := budget.NewRatio(budget.RatioConfig{}, clock.Real)
	backoff := budget.Backoff{Rand: func() float64 { return 0.5 }} // deterministic here

	retries.Request() // one original request
	for attempt := 0; attempt < 3; attempt++ {
		// ... the attempt fails with a 503 carrying Retry-After: 1 ...
		retryAfter, _ := budget.ParseRetryAfter("1", time.Now())
		if !retries.TryRetry() {
			fmt.Println("budget spent: return the 503 now")
			return
		}
		d, ok := backoff.Delay(attempt, retryAfter, 30*time.Second)
		if !ok {
			fmt.Println("Retry-After does not fit the deadline: return the 503 now")
			return
		}
		fmt.Printf("retry %d after %v\n", attempt+1, d)
	}
	// Output:
	// retry 1 after 1s
	// retry 2 after 1s
	// retry 3 after 1s
}

// A token bucket of 10 retries refilled at 0.5/s.
func ExampleNewBucket() {
	clk := clocktest.New(t0)
	b, _ := budget.NewBucket(10, 0.5, clk)
	granted := 0
	for b.TryRetry() {
		granted++
	}
	fmt.Println("burst:", granted)
	clk.Advance(4 * time.Second)
	fmt.Println("after 4s:", b.Stats().Available)
	// Output:
	// burst: 10
	// after 4s: 2
}
