package caddymodule

import (
	"math/rand/v2"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
)

// Caddy's least_conn and random_choose read reverseproxy.Host request
// counts, which only Caddy's own reverse_proxy can increment. These two
// policies keep their semantics but count the gateway's attempts in flight.
// Provision swaps them in when the configured policy is one of those two.

// leastConn selects the available upstream with the fewest attempts in
// flight, breaking ties uniformly at random (reservoir sampling), as
// reverseproxy.LeastConnSelection does.
type leastConn struct {
	inflight func(*reverseproxy.Upstream) int64
}

func (s leastConn) Select(pool reverseproxy.UpstreamPool, _ *http.Request, _ http.ResponseWriter) *reverseproxy.Upstream {
	var best *reverseproxy.Upstream
	var ties int
	least := int64(-1)
	for _, u := range pool {
		if !u.Available() {
			continue
		}
		n := s.inflight(u)
		if least == -1 || n < least {
			least, ties = n, 0
		}
		if n == least {
			ties++
			if ties == 1 || rand.IntN(ties) == 0 {
				best = u
			}
		}
	}
	return best
}

// randomChoose samples Choose available upstreams uniformly and selects the
// one with the fewest attempts in flight ("power of two choices" when
// Choose is 2), as reverseproxy.RandomChoiceSelection does.
type randomChoose struct {
	choose   int
	inflight func(*reverseproxy.Upstream) int64
}

func (s randomChoose) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	k := min(max(s.choose, 1), len(pool))
	var buf [8]*reverseproxy.Upstream
	choices := buf[:0]
	if k > len(buf) {
		choices = make([]*reverseproxy.Upstream, 0, k)
	}
	available := 0
	for _, u := range pool {
		if !u.Available() {
			continue
		}
		available++
		if len(choices) < k {
			choices = append(choices, u)
			continue
		}
		if j := rand.IntN(available); j < k {
			choices[j] = u
		}
	}
	return leastConn{inflight: s.inflight}.Select(choices, r, w)
}

var (
	_ reverseproxy.Selector = leastConn{}
	_ reverseproxy.Selector = randomChoose{}
)
