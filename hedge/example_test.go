package hedge_test

import (
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/hedge"
)

func ExampleParseAfter() {
	// hedge { after p95 min 100ms max 2s }
	p, err := hedge.ParseAfter([]string{"p95", "min", "100ms", "max", "2s"})
	if err != nil {
		panic(err)
	}
	fmt.Println(p)

	tr := hedge.NewLatencyTracker(hedge.DefaultHalfLife, nil)
	fmt.Println("no samples yet:", p.Delay(tr))
	for i := range 100 {
		tr.Observe(time.Duration(100+10*i) * time.Millisecond) // 100ms … 1.09s
	}
	fmt.Println("p95 of 100ms…1.09s:", p.Delay(tr).Round(10*time.Millisecond))

	_, err = hedge.ParseAfter([]string{"p95", "min", "3s", "max", "2s"})
	fmt.Println(err)
	// Output:
	// p95 min 100ms max 2s
	// no samples yet: 2s
	// p95 of 100ms…1.09s: 1.05s
	// invalid hedge delay: after p95 min 3s max 2s: min 3s is above max 2s
}

func ExampleRateCap() {
	// max_ratio 0.1, and the default floor of 1 hedge a second: the 10s
	// window grants 0.1 × requests + 10.
	c, err := hedge.NewRateCap(hedge.RateCapConfig{MaxRatio: 0.1}, nil)
	if err != nil {
		panic(err)
	}
	// A quiet pool: its first request stalls and may hedge at once.
	c.Request()
	fmt.Println("first request hedges:", c.TryHedge())

	granted := 1
	for range 49 {
		c.Request()
		if c.TryHedge() { // every request is slow and wants a backup
			granted++
		}
	}
	req, hedges := c.Stats()
	fmt.Println(granted, req, hedges)
	// Output:
	// first request hedges: true
	// 15 50 15
}

func ExampleRateCapConfig_off() {
	// Without the floor, hedges are 0.1 × requests: a pool with fewer than
	// 10 requests in the window does not hedge.
	c, err := hedge.NewRateCap(hedge.RateCapConfig{MaxRatio: 0.1, MinPerSec: hedge.Off}, nil)
	if err != nil {
		panic(err)
	}
	for i := 1; i <= 10; i++ {
		c.Request()
		if c.TryHedge() {
			fmt.Println("first hedge at request", i)
		}
	}
	// Output: first hedge at request 10
}
