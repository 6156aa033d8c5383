// Command bodyburst sends a burst of concurrent requests with large bodies
// to a gateway and prints a markdown table of what it cost the gateway's
// process in memory: bodies admitted and refused, RSS before, at its peak
// and after, growth, and growth over the bodies admitted. It exits 1 when a
// request was lost (neither 200 nor the body budget's 503). Used by
// scripts/bench-bodies.sh.
//
//	bodyburst --url http://127.0.0.1:8080/v1/chat/completions --pid 1234 --bodies 20 --size 15MiB
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"time"

	"github.com/dustin/go-humanize"

	"github.com/llmproxy/caddy-llm-proxy/internal/bodyburst"
)

func main() {
	url := flag.String("url", "http://127.0.0.1:8080/v1/chat/completions", "the gateway's chat completions URL (loopback)")
	pid := flag.Int("pid", 0, "the gateway's process id, whose RSS is measured (0: none)")
	bodies := flag.Int("bodies", 20, "concurrent requests")
	size := flag.String("size", "15MiB", "each request body's size")
	model := flag.String("model", "mock-llama", "the requests' model")
	timeout := flag.Duration("timeout", 60*time.Second, "bound on the whole burst")
	flag.Parse()
	n, err := humanize.ParseBytes(*size)
	if err != nil || n == 0 || n > 1<<30 || *bodies < 1 || *bodies > 1000 {
		fmt.Fprintf(os.Stderr, "bodyburst: want --bodies 1..1000 and --size up to 1GiB (got %d, %q)\n", *bodies, *size)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	res, err := bodyburst.Run(ctx, bodyburst.Config{URL: *url, Bodies: *bodies, Size: int(n), Model: *model, PID: *pid, Timeout: *timeout})
	if err != nil {
		fmt.Fprintln(os.Stderr, "bodyburst:", err)
		os.Exit(1)
	}
	fmt.Print(res.Markdown())
	for _, e := range res.Errors {
		fmt.Fprintln(os.Stderr, "bodyburst: lost request:", e)
	}
	if res.Other > 0 {
		os.Exit(1)
	}
}
