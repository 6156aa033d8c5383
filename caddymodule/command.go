package caddymodule

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/llmproxy/caddy-llm-proxy/internal/statusview"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "llm-proxy",
		Usage: "status [--address <interface>] [--json] [--watch [--interval <duration>]]",
		Short: "Shows the llm_proxy gateway's upstreams, tenants and fleet state",
		Long: `
Commands of the llm_proxy module. One so far:

  status    reads the running Caddy's admin API (GET /llm_proxy/breakers,
            /llm_proxy/saturation, /llm_proxy/tenants, /llm_proxy/fleet and
            /llm_proxy/pools) and prints tables of the upstreams, the
            tenants and the fleet, with notes on the pools.

See 'caddy llm-proxy status --help'.
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.Args = cobra.NoArgs
			cmd.RunE = func(cmd *cobra.Command, _ []string) error { return cmd.Help() }
			cmd.AddCommand(statusCommand())
		},
	})
}

// statusCommand is `caddy llm-proxy status`.
func statusCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "status [--address <interface>] [--config <path> [--adapter <name>]] [--json] [--watch [--interval <duration>]]",
		Short: "Prints the gateway's upstreams, tenants and fleet state",
		Long: `
Reads the admin API of a running Caddy with llm_proxy and prints:

  UPSTREAMS  each upstream (dial address) with its breaker's state and time
             in it ("forced" when an operator opened it, "sat" when its
             saturation signals did), its attempts in flight, its
             saturation score (1 is saturated, ? unknown) and the age of
             its latest /metrics scrape, and its breaker's last failure;
             breakers per model below their upstream ("due" once a
             cooldown has passed); below the table, each pool that failed
             as a whole, is in panic or has upstreams ejected.
  TENANTS    each tenant with state: tier, requests in flight (of its
             max_concurrent), queued, requests and tokens in the rolling
             minute (of its rpm and tpm), its tenant breaker.
  FLEET      fleet (Redis shared), local (Redis away) or off, and the
             instances seen recently.

Lines fit 80 columns (a terminal's width when wider). The admin endpoint is
--address if given, else the admin address of the --config file, else
$CADDY_ADMIN, else localhost:2019, as for 'caddy stop' and 'caddy reload'.

--json prints the admin API's bodies unchanged in one object keyed by
endpoint ({"breakers": […], "fleet": {…}, "pools": […], "saturation": […],
"tenants": […]})
for scripts. --watch prints anew every --interval (default 2s), in place on
a terminal, until Ctrl-C; with --json, one object per line.
`,
		Args: cobra.NoArgs,
		RunE: caddycmd.WrapCommandFuncForCobra(cmdStatus),
	}
	cmd.Flags().StringP("address", "", "", "The address of the admin API, if not the config's, $CADDY_ADMIN or localhost:2019")
	cmd.Flags().StringP("config", "c", "", "Configuration file to read the admin address from, if --address is not used")
	cmd.Flags().StringP("adapter", "a", "", "Name of config adapter to apply (when --config is used)")
	cmd.Flags().BoolP("json", "", false, "Print the admin API's JSON, one object keyed by endpoint")
	cmd.Flags().BoolP("watch", "w", false, "Print anew every --interval until interrupted")
	cmd.Flags().StringP("interval", "", "2s", "How often --watch prints (a Caddy duration)")
	return cmd
}

// statusRun is one invocation of `caddy llm-proxy status`.
type statusRun struct {
	// addr is the admin endpoint in Caddy's network address form.
	addr string
	// json prints the combined JSON instead of tables.
	json bool
	// watch prints anew every interval until the context ends.
	watch bool
	// errOut receives --watch --json's failed reads (nil: os.Stderr).
	errOut   io.Writer
	interval time.Duration
	// tty clears the screen before each print of --watch (ANSI codes);
	// width is the line width of the tables (0: 80).
	tty   bool
	width int
	// timeout bounds one read of the admin API.
	timeout time.Duration
}

func cmdStatus(fl caddycmd.Flags) (int, error) {
	addr, err := caddycmd.DetermineAdminAPIAddress(fl.String("address"), nil, fl.String("config"), fl.String("adapter"))
	if err != nil {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("couldn't determine admin API address: %v", err)
	}
	interval, err := caddy.ParseDuration(fl.String("interval"))
	if err != nil || interval <= 0 {
		return caddy.ExitCodeFailedStartup, fmt.Errorf("--interval %q: want a positive duration such as 2s", fl.String("interval"))
	}
	run := statusRun{addr: addr, json: fl.Bool("json"), watch: fl.Bool("watch"), interval: interval, timeout: 10 * time.Second}
	if fd := int(os.Stdout.Fd()); term.IsTerminal(fd) {
		run.tty = true
		if w, _, err := term.GetSize(fd); err == nil && w > statusview.DefaultWidth {
			run.width = w
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run.run(ctx, os.Stdout); err != nil {
		return caddy.ExitCodeFailedStartup, err
	}
	return caddy.ExitCodeSuccess, nil
}

// run prints the status once, or with watch every interval until ctx ends
// (then it returns nil). Once, a failed read of the admin API is its
// error; with watch it is printed in place of the tables and the next
// interval tries again.
func (r statusRun) run(ctx context.Context, w io.Writer) error {
	f := &statusFetcher{addr: r.addr}
	if !r.watch {
		out, err := r.frame(ctx, f)
		if err != nil {
			return err
		}
		_, err = w.Write(out)
		return err
	}
	tick := time.NewTicker(r.interval)
	defer tick.Stop()
	for {
		out, err := r.frame(ctx, f)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			msg := fmt.Appendf(nil, "llm-proxy status of %s at %s: %v\n", r.addr, time.Now().UTC().Format("15:04:05 UTC"), err)
			if r.json {
				// Scripts read one JSON object per line on stdout: the
				// failed read goes to stderr, and nothing to stdout.
				errOut := r.errOut
				if errOut == nil {
					errOut = os.Stderr
				}
				_, _ = errOut.Write(msg)
				select {
				case <-ctx.Done():
					return nil
				case <-tick.C:
				}
				continue
			}
			out = msg
		}
		if r.tty {
			out = append([]byte("\x1b[H\x1b[2J"), out...)
		}
		if !r.json {
			out = fmt.Appendf(out, "\nevery %v; Ctrl-C ends\n", r.interval)
		}
		if _, err := w.Write(out); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// frame reads the admin API and returns what one print shows: the
// combined JSON and a newline, or the tables.
func (r statusRun) frame(ctx context.Context, f *statusFetcher) ([]byte, error) {
	combined, err := f.get(ctx, r.timeout)
	if err != nil {
		return nil, err
	}
	if r.json {
		return append(combined, '\n'), nil
	}
	s, err := statusview.Parse(combined)
	if err != nil {
		return nil, fmt.Errorf("admin API at %s: %w", r.addr, err)
	}
	var b bytes.Buffer
	err = statusview.Render(&b, s, statusview.Options{Now: time.Now(), Width: r.width, Address: r.addr})
	return b.Bytes(), err
}

// statusFetcher reads the admin API's status endpoints, one read at a
// time: caddycmd.AdminAPIRequest takes no deadline, so a read that
// outlives its caller's timeout is waited for by the next call instead
// of being started again.
type statusFetcher struct {
	addr    string
	pending chan fetchResult
}

type fetchResult struct {
	combined []byte
	err      error
}

// get returns the combined JSON of statusview.Endpoints: each endpoint's
// body, unchanged, under its name. It fails when an endpoint fails or
// does not answer JSON, when timeout passes, or when ctx ends.
func (f *statusFetcher) get(ctx context.Context, timeout time.Duration) ([]byte, error) {
	if f.pending == nil {
		ch := make(chan fetchResult, 1)
		go func() {
			b, err := fetchStatus(f.addr)
			ch <- fetchResult{b, err}
		}()
		f.pending = ch
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case res := <-f.pending:
		f.pending = nil
		return res.combined, res.err
	case <-t.C:
		return nil, fmt.Errorf("admin API at %s: no answer within %v", f.addr, timeout)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// maxStatusBody bounds one endpoint's body (a fleet with thousands of
// tenants stays far below it).
const maxStatusBody = 64 << 20

// fetchStatus GETs every endpoint of statusview.Endpoints from the admin
// API at addr, as Caddy's own commands reach it.
func fetchStatus(addr string) ([]byte, error) {
	combined := make(map[string]json.RawMessage, len(statusview.Endpoints))
	for _, e := range statusview.Endpoints {
		path := "/llm_proxy/" + e
		resp, err := caddycmd.AdminAPIRequest(addr, http.MethodGet, path, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("GET %s from the admin API at %s: %w", path, addr, err)
		}
		body, err := io.ReadAll(io.LimitReader(resp.Body, maxStatusBody+1))
		resp.Body.Close()
		if err != nil {
			return nil, fmt.Errorf("GET %s from the admin API at %s: reading the body: %w", path, addr, err)
		}
		if len(body) > maxStatusBody {
			return nil, fmt.Errorf("GET %s from the admin API at %s: the body is larger than %d MiB", path, addr, maxStatusBody>>20)
		}
		if !json.Valid(body) {
			return nil, fmt.Errorf("GET %s from the admin API at %s: the body is not JSON (%d bytes): is this a Caddy with llm_proxy?", path, addr, len(body))
		}
		combined[e] = body
	}
	return json.Marshal(combined)
}
