package upstream

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/clock"
)

// Defaults of Prober.
const (
	// DefaultProbeInterval is the time between active probes while a
	// breaker is not closed.
	DefaultProbeInterval = 5 * time.Second
	// DefaultProbeURI is the GET probe's path when neither URI nor Chat is set.
	DefaultProbeURI = "/health"
	// maxProbeBody bounds the probe response read.
	maxProbeBody = 1 << 20
	// probePoll bounds how long an open breaker whose cooldown is over, or
	// that won the fleet's probe lease (breaker.ProbeNow), waits for its
	// first probe; a half-open breaker's probes stay Interval apart.
	probePoll = 250 * time.Millisecond
)

// Prober sends the gateway's own probes to an upstream whose breaker is not
// closed (active probing), so that no user request is risked on it: users
// are routed elsewhere until the breaker's RecoverySuccesses probes pass.
// One probe loop runs per upstream entry, however many configs ask for it;
// each breaker policy's breakers are probed with the Prober of the newest
// started handler that uses the policy (see Entry).
type Prober struct {
	// Transport sends the probe (the handler's transport). Required.
	Transport http.RoundTripper
	// Dial decorates the probe's context with what Transport needs to
	// reach the upstream at addr (Caddy's dial info). Optional.
	Dial func(ctx context.Context, addr string) context.Context
	// URI is the path of a GET probe. Default DefaultProbeURI when Chat is empty.
	URI string
	// Chat, when set, is a JSON body POSTed to /v1/chat/completions instead
	// of the GET.
	Chat string
	// Interval is the time between probes. Default DefaultProbeInterval.
	Interval time.Duration
	// Timeout bounds one probe: the handler's first_byte_timeout, so a
	// hanging probe fails when a hanging user attempt would. Default 60s.
	Timeout time.Duration
}

// request identifies the probe a Prober sends: probers that send the same
// one share its answer.
func (p *Prober) request() string {
	return fmt.Sprintf("%s\x00%s\x00%v", cmp.Or(p.URI, DefaultProbeURI), p.Chat, p.Timeout)
}

func (p *Prober) interval() time.Duration {
	if p.Interval > 0 {
		return p.Interval
	}
	return DefaultProbeInterval
}

// errProbeTimeout is the cause of a probe's cancellation at its timeout.
var errProbeTimeout = errors.New("probe timeout")

// send runs one probe against addr: success is a 2xx with a complete body
// within Timeout, as clk counts it (the registry's clock). It ends early
// when ctx does (the entry was released).
func (p *Prober) send(ctx context.Context, clk clock.Clock, addr string) error {
	timeout := p.Timeout
	if timeout <= 0 {
		timeout = 60 * time.Second
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	t := clk.AfterFunc(timeout, func() { cancel(errProbeTimeout) })
	defer t.Stop()
	if p.Dial != nil {
		ctx = p.Dial(ctx, addr)
	}
	method, path, body := http.MethodGet, p.URI, io.Reader(nil)
	if path == "" {
		path = DefaultProbeURI
	}
	if p.Chat != "" {
		method, path, body = http.MethodPost, "/v1/chat/completions", strings.NewReader(p.Chat)
	}
	req, err := http.NewRequestWithContext(ctx, method, "http://"+addr+path, body)
	if err != nil {
		return err
	}
	req.URL.Scheme = "" // the transport sets http or https
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	req.Header.Set("User-Agent", "caddy-llm-proxy-probe")
	timedOut := func(err error) error {
		if errors.Is(context.Cause(ctx), errProbeTimeout) {
			return fmt.Errorf("probe %s %s: no response within %v: %w", method, path, timeout, context.DeadlineExceeded)
		}
		return err
	}
	resp, err := p.Transport.RoundTrip(req)
	if err != nil {
		return timedOut(err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, io.LimitReader(resp.Body, maxProbeBody)); err != nil {
		return timedOut(fmt.Errorf("reading probe response: %w", err))
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("probe %s %s: status %d", method, path, resp.StatusCode)
	}
	return nil
}

// maybeProbe starts the entry's probe loop when the effective config has
// started and probes actively, some breaker is not closed, and no loop runs. The loop belongs
// to the entry, not to a config: it survives reloads (handed over to the
// newest config's Prober) and stops when every breaker is closed, active
// probing is turned off, or the entry is destroyed.
func (e *Entry) maybeProbe() {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.probing || !e.probeWantedLocked() {
		return
	}
	e.probing = true
	e.reg.loops.Add(1)
	go e.probeLoop()
}

// probeWantedLocked reports whether a probe loop should run: the loop is
// started and stopped with the llm_proxy app (only a started config's
// prober runs), and only while a breaker is not closed.
func (e *Entry) probeWantedLocked() bool {
	return !e.destroyed && e.proberLocked() != nil && e.anyOpenLocked()
}

// proberLocked returns the Prober the entry's loop paces itself by: the
// newest started claim's that probes actively (a handler with breakers
// off, or passive recovery, never stops another handler's probes); nil
// when none does.
func (e *Entry) proberLocked() *Prober {
	var best *claim
	for _, c := range e.claims {
		if c.settings != nil && c.prober != nil && c.active.Load() && (best == nil || c.newerThan(best)) {
			best = c
		}
	}
	if best == nil {
		return nil
	}
	return best.prober
}

func (e *Entry) anyOpenLocked() bool {
	for _, v := range e.verdictList() {
		if v.b.State() != breaker.Closed {
			return true
		}
	}
	return false
}

// probeLoop probes every interval; one probe answers for every breaker of
// the entry that is due (the server is back or not, whatever the model).
// It looks every probePoll for an open breaker that became due, so that
// the first probe follows the cooldown's end (or a fleet probe lease won,
// which is shorter than the interval) at once.
func (e *Entry) probeLoop() {
	defer e.reg.loops.Add(-1)
	var last time.Time // when the last probe was sent
	for {
		e.mu.Lock()
		if !e.probeWantedLocked() {
			e.probing = false
			e.mu.Unlock()
			return
		}
		p := e.proberLocked()
		e.mu.Unlock()
		t := e.reg.clock.NewTimer(min(p.interval(), probePoll))
		select {
		case <-e.ctx.Done():
			t.Stop()
			e.mu.Lock()
			e.probing = false
			e.mu.Unlock()
			return
		case <-t.C():
		}
		spaced := e.reg.now().Sub(last) >= p.interval()
		// Each handler's breakers are probed with its own Prober (else
		// the loop's); one probe answers for every breaker whose
		// Prober sends the same request, so handlers with one probe
		// config cost the upstream one probe per interval.
		var byProbe map[string]*Prober
		var byProber map[*Prober][]breaker.Permit
		for _, v := range e.verdictList() {
			b := v.b
			if !spaced && b.State() != breaker.Open || !b.ProbeDue() {
				continue
			}
			if permit, ok := b.AllowProbe(); ok {
				if byProber == nil {
					byProber, byProbe = map[*Prober][]breaker.Permit{}, map[string]*Prober{}
				}
				pr := cmp.Or(v.c.prober, p)
				if same, ok := byProbe[pr.request()]; ok {
					pr = same
				} else {
					byProbe[pr.request()] = pr
				}
				byProber[pr] = append(byProber[pr], permit)
			}
		}
		if len(byProber) == 0 {
			continue
		}
		last = e.reg.now()
		for pr, permits := range byProber {
			err := pr.send(e.ctx, e.reg.clock, e.addr)
			for i := range permits {
				switch {
				case e.ctx.Err() != nil:
					// Released while probing: the answer says nothing.
					permits[i].Done(breaker.Neutral, 0, "")
				case err != nil:
					permits[i].Done(breaker.Failure, 0, "active probe: "+err.Error())
				default:
					permits[i].Done(breaker.Success, 0, "")
				}
			}
		}
	}
}
