package upstream

import (
	"fmt"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

// record gives an attempt's outcome to its upstream's breaker: the upstream
// column of DESIGN §4's failure table, in one place.
//
//   - upstream faults (connection errors, first-byte timeouts, 5xx, 429,
//     in-band 5xx-like and rate-limit errors, truncated streams, idle
//     timeouts) are failures, with the TTFT for the slow-call rule;
//   - a success is a success, with its TTFT (slow_ttft may still count it);
//   - a 4xx is the client's fault: neutral, so a stream of bad requests
//     neither resets a failing upstream's run of failures nor dilutes its
//     failure ratio; but a half-open probe answered with a 4xx proves the
//     server is back, so there it is a success;
//   - a cancelled attempt (client gone, hedge loser, config unloaded), the
//     client's own stream_timeout, a gateway panic, and a pick given back
//     unused (rep nil) are neutral.
//
// Connection errors and first-byte timeouts are breaker.Down: a run of them
// with no sign of life between is hard evidence of a dead or hanging
// server; every other fault is a plain failure, which trips the breaker
// only with no success in the window or as a statistical outlier of its
// pool (the pool's outlier detector, outliers.go). A mix of first-byte timeouts and successes is
// therefore statistical: a server that holds some requests and answers
// others is judged against its pool, not declared down.
//
// A 429 or 503 with Retry-After also keeps the breaker open that long.
func record(b *breaker.Breaker, p *breaker.Permit, rep *proxy.AttemptReport) {
	retryAfter := func() {
		if rep != nil && rep.RetryAfter > 0 {
			b.ExtendOpen(rep.RetryAfter, fmt.Sprintf("upstream answered %d with Retry-After %v", rep.Status, rep.RetryAfter))
		}
	}
	if p.Probe() {
		// A probe answered with Retry-After re-opens for what the
		// upstream asked; its failure, recorded after, changes nothing.
		retryAfter()
	}
	switch o := outcomeOf(rep); {
	case o == breaker.Success:
		p.Done(breaker.Success, rep.TTFT, "") // slow_ttft may count it
	case o == breaker.Neutral && answered(rep) && p.Probe():
		p.Done(breaker.Success, 0, "")
	case o == breaker.Neutral:
		p.Done(breaker.Neutral, 0, "")
	default:
		p.Done(o, rep.TTFT, reasonOf(rep))
	}
	if !p.Probe() {
		retryAfter()
	}
}

// outcomeOf is the upstream column of DESIGN §4 for one attempt: Down for a
// refused or reset connection and a first-byte timeout, Failure for every
// other upstream fault, Success for a success, Neutral for the rest (a
// 4xx, a cancelled attempt, a pick given back unused: rep nil).
func outcomeOf(rep *proxy.AttemptReport) breaker.Outcome {
	if rep == nil {
		return breaker.Neutral
	}
	switch o := rep.Outcome; {
	case o == proxy.AttemptSuccess:
		return breaker.Success
	case o == proxy.AttemptConnectError || o == proxy.AttemptFirstByteTimeout:
		return breaker.Down
	case o.UpstreamFault():
		return breaker.Failure
	}
	return breaker.Neutral
}

// answered reports whether the upstream answered the attempt with a
// client error (a 4xx, or an in-band 4xx-like error): neutral evidence, but
// proof that the server is up.
func answered(rep *proxy.AttemptReport) bool {
	return rep != nil && (rep.Outcome == proxy.AttemptHTTP4xx || rep.Outcome == proxy.AttemptInbandError4xx)
}

// reasonOf is an attempt's failure as a breaker records it ("" for a
// success).
func reasonOf(rep *proxy.AttemptReport) string {
	if rep == nil || rep.Outcome == proxy.AttemptSuccess {
		return ""
	}
	return rep.Outcome.String()
}
