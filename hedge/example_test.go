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
	c, err := hedge.NewRateCap(0.1, 10*time.Second, nil) // max_ratio 0.1
	if err != nil {
		panic(err)
	}
	granted := 0
	for range 50 {
		c.Request()
		if c.TryHedge() { // every request is slow and wants a backup
			granted++
		}
	}
	req, hedges := c.Stats()
	fmt.Println(granted, req, hedges)
	// Output: 5 50 5
}
