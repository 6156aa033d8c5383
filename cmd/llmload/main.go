// Command llmload drives load against OpenAI-compatible chat completion
// endpoints and measures what LLM clients feel: time to first token (TTFT),
// the gaps between streamed events, and how each request ended.
//
// Usage:
//
//	llmload run --url http://127.0.0.1:8089/v1/chat/completions --concurrency 8 --duration 20s \
//	    [--requests N] [--rate R] [--stream=true] [--metrics-url http://127.0.0.1:2019/metrics] [--json out.json] \
//	    [--mock http://127.0.0.1:9101] [--warmup 10s] [--label name]
//	llmload overhead --direct http://127.0.0.1:9201 --llm-proxy http://127.0.0.1:8091 \
//	    --reverse-proxy http://127.0.0.1:8092 [--streams 1,100] [--requests-per-level N] [--json out.json]
//	llmload compare [--target-speedup 5] [--target-max-extra 10] base.json hedged.json
//	llmload isolation --plain http://127.0.0.1:8097 --admission http://127.0.0.1:8098 \
//	    --noisy-key KA --victim-keys KB,KC,KD [--mock http://127.0.0.1:9401] [--access-log file] [--plot out.png]
//	llmload overload --target round_robin=http://127.0.0.1:8111 --target least_conn=http://127.0.0.1:8112 \
//	    --target least_queue=http://127.0.0.1:8113 [--mock http://127.0.0.1:9501]... --rate 30 [--plot out.png]
//	llmload prefix --target round_robin=http://127.0.0.1:8121 --target prefix_cache=http://127.0.0.1:8123 \
//	    --mock http://127.0.0.1:9601 [--conversations 36 --turns 4 --concurrency 9] [--plot out.png]
//	llmload suite run --scenario S4 --out DIR --target direct=URL --target llm_proxy=URL --pid llm_proxy=PID ...
//	llmload suite report --dir DIR --md DIR/suite.md [--docs docs/benchmarks.md --img docs/img]
//
// Every run is bounded (by duration and/or request count), and llmload only
// targets this machine unless --allow-remote is given.
package main

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
)

const usage = `llmload: load generator and scenario driver for OpenAI-style endpoints

Usage:
  llmload run [flags]        bounded load against one endpoint, with a summary
  llmload overhead [flags]   compare TTFT and event gaps: direct vs llm_proxy vs reverse_proxy
  llmload compare [flags] base.json other.json
                             compare run reports (e.g. without and with hedging): markdown table, verdict
  llmload table run.json...  one row per run report: API, requests, ok, TTFT, failures
  llmload isolation [flags]  noisy neighbour: victims' TTFT alone, with a noisy tenant without and with
                             admission control; A's refusal latency; a PNG of the TTFT CDFs
  llmload overload [flags]   selection under overload: the same open-loop load through gateways that
                             differ in lb_policy, one after another; TTFT, throughput, replica shares
  llmload prefix [flags]     multi-turn conversations through gateways that differ in lb_policy, to a mock
                             fleet with a prefix cache: hit ratio, TTFT p50/p99, replica shares (S8)

Run 'llmload <command> -h' for the flags of a command.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "run":
		err = runCmd(os.Args[2:])
	case "overhead":
		err = overheadCmd(os.Args[2:])
	case "compare":
		err = compareCmd(os.Args[2:])
	case "table":
		err = tableCmd(os.Args[2:])
	case "isolation":
		err = isolationCmd(os.Args[2:])
	case "overload":
		err = overloadCmd(os.Args[2:])
	case "prefix":
		err = prefixCmd(os.Args[2:])
	case "suite":
		err = suiteCmd(os.Args[2:])
	case "-h", "--help", "help":
		fmt.Print(usage)
		return
	default:
		fmt.Fprintf(os.Stderr, "llmload: unknown command %q\n\n%s", os.Args[1], usage)
		os.Exit(2)
	}
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0)
	case errors.Is(err, errFlags):
		os.Exit(2) // the flag package has printed the error and the usage
	case errors.Is(err, errUsage):
		fmt.Fprintf(os.Stderr, "llmload: %v\n", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintf(os.Stderr, "llmload: %v\n", err)
		os.Exit(1)
	}
}

var (
	// errUsage marks an error in the command line (exit status 2).
	errUsage = errors.New("usage error")
	// errFlags marks a flag parsing error, already reported.
	errFlags = errors.New("invalid flags")
)

func usageErrorf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errUsage, fmt.Sprintf(format, args...))
}

// checkTarget parses a target URL and refuses one that is not on this
// machine (a loopback address or localhost) unless remote is allowed.
func checkTarget(raw string, allowRemote bool) (*url.URL, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("url %q: %w", raw, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("url %q: scheme must be http or https", raw)
	}
	if u.Host == "" {
		return nil, fmt.Errorf("url %q: no host", raw)
	}
	if !allowRemote && !isLoopbackHost(u.Hostname()) {
		return nil, fmt.Errorf("url %q: %s is not a loopback address; llmload only loads this machine unless --allow-remote is given", raw, u.Hostname())
	}
	return u, nil
}

// isLoopbackHost reports whether host is a loopback IP or a localhost name.
// Names other than localhost are not resolved: DNS could point anywhere.
func isLoopbackHost(host string) bool {
	if ip := net.ParseIP(host); ip != nil {
		return ip.IsLoopback()
	}
	h := strings.ToLower(strings.TrimSuffix(host, "."))
	return h == "localhost" || strings.HasSuffix(h, ".localhost")
}

// headerFlag collects repeated --header 'Key: Value' flags.
type headerFlag struct{ h http.Header }

func (f *headerFlag) String() string {
	if f == nil || f.h == nil {
		return ""
	}
	var parts []string
	for k, vs := range f.h {
		for _, v := range vs {
			parts = append(parts, k+": "+v)
		}
	}
	return strings.Join(parts, ", ")
}

func (f *headerFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, ":")
	k = strings.TrimSpace(k)
	if !ok || k == "" {
		return fmt.Errorf("header %q: want 'Key: Value'", s)
	}
	if f.h == nil {
		f.h = http.Header{}
	}
	f.h.Add(k, strings.TrimSpace(v))
	return nil
}

// newFlagSet returns a flag set that reports errors instead of exiting.
func newFlagSet(name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet("llmload "+name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: llmload %s [flags]\n\n%s\n\nFlags:\n", name, synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args, rejecting stray positional arguments.
func parseFlags(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return err
		}
		return fmt.Errorf("%w: %v", errFlags, err)
	}
	if fs.NArg() > 0 {
		fs.Usage()
		return usageErrorf("unexpected argument %q", fs.Arg(0))
	}
	return nil
}
