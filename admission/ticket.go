package admission

import (
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// ticketState is the Ticket's fields (the type is declared in api.go).
type ticketState struct {
	c        *Controller
	t        *tenant
	ti       *tierInfo
	lim      limits
	est      int   // the prompt estimate
	reserved int64 // tokens counted in the window at ep
	ep       int64
	permit   breaker.Permit // the tenant breaker's; zero when none
	limits   Limits         // pointing at reqLim and tokLim
	reqLim   Limit
	tokLim   Limit
	settled  atomic.Bool
	// quota is what the request asked of its limits; hold what a
	// LimitStore took (hold.store nil: the tenant's own counts did).
	quota Quota
	hold  Hold
}

// ttftObjective returns the tier's TTFT objective for a prompt of prompt
// tokens: TTFTSLO + TTFTPer1kPrompt × prompt / 1000, saturating.
func ttftObjective(ti *tierInfo, prompt int) time.Duration {
	extra := int64(0)
	if p := int64(max(prompt, 0)); p > 0 && ti.TTFTPer1kPrompt > 0 {
		per := int64(ti.TTFTPer1kPrompt)
		if p > math.MaxInt64/per {
			return math.MaxInt64
		}
		extra = per * p / 1000
	}
	return time.Duration(satAdd(int64(ti.TTFTSLO), extra))
}

// slowCall reports whether a successful request missed its tier's
// objectives, and why (built only when it did).
func slowCall(ti *tierInfo, u *Usage, prompt int, queueWait time.Duration) (bool, string) {
	if ti.TTFTSLO > 0 && u.TTFT > 0 {
		if obj := ttftObjective(ti, prompt); u.TTFT > obj {
			return true, fmt.Sprintf("slow call: ttft %s > objective %s (ttft_slo %s + %s per 1k × %d prompt tokens)",
				u.TTFT, obj, ti.TTFTSLO, ti.TTFTPer1kPrompt, prompt)
		}
	}
	if ti.QueueWaitSLO > 0 && queueWait > ti.QueueWaitSLO {
		return true, fmt.Sprintf("slow call: queue wait %s > queue_wait_slo %s", queueWait, ti.QueueWaitSLO)
	}
	return false, ""
}

func (tk *Ticket) settle(u *Usage, queueWait time.Duration) {
	if tk.t == nil || !tk.settled.CompareAndSwap(false, true) {
		return
	}
	c, t := tk.c, tk.t
	prompt, completion := max(u.PromptTokens, 0), max(u.CompletionTokens, 0)
	used := satAdd(int64(prompt), int64(completion))
	if s := tk.hold.store; s != nil {
		s.Settle(&tk.hold, used)
		t.mu.Lock()
		t.inflight--
		t.mu.Unlock()
	} else {
		now := c.clock.Now()
		t.mu.Lock()
		t.win.advance(now)
		t.win.remove(tk.ep, 0, tk.reserved)
		t.win.add(0, used)
		t.inflight--
		t.mu.Unlock()
	}

	source := "usage"
	if u.Estimated {
		source = "estimate"
	}
	if prompt > 0 {
		c.obs.Tokens(t.id, tk.ti.Name, u.API, "prompt", source, prompt)
	}
	if completion > 0 {
		c.obs.Tokens(t.id, tk.ti.Name, u.API, "completion", source, completion)
	}

	switch u.Verdict {
	case VerdictFailure:
		tk.permit.Done(breaker.Failure, u.TTFT, "tenant's own failure")
	case VerdictSuccess:
		p := prompt
		if p == 0 {
			p = tk.est
		}
		slow, why := slowCall(tk.ti, u, p, queueWait)
		switch {
		case !slow:
			// TTFT 0: the breaker's own slow rule never fires.
			tk.permit.Done(breaker.Success, 0, "")
		case tk.ti.slowRatio:
			// Counted by the breaker's SlowRatio rule as well.
			tk.permit.Done(breaker.Success, 2*slowMark, why)
		default:
			tk.permit.Done(breaker.Failure, u.TTFT, why)
		}
	default:
		tk.permit.Done(breaker.Neutral, 0, "")
	}
}

func (tk *Ticket) cancel() {
	if tk.t == nil || !tk.settled.CompareAndSwap(false, true) {
		return
	}
	t := tk.t
	if s := tk.hold.store; s != nil {
		s.Cancel(&tk.hold)
		t.mu.Lock()
		t.inflight--
		t.mu.Unlock()
	} else {
		now := tk.c.clock.Now()
		t.mu.Lock()
		t.win.advance(now)
		t.win.remove(tk.ep, 1, tk.reserved)
		t.inflight--
		t.mu.Unlock()
	}
	tk.permit.Done(breaker.Neutral, 0, "") // frees a probe slot, records nothing
}
