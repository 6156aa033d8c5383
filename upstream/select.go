package upstream

import (
	"math/rand/v2"
	"net/http"
)

// Selector is a selection policy: it chooses one of the candidates (which
// are never empty) and returns its index, or -1 when it will not choose.
// r and w are the client's request and writer, for policies that hash a
// header or set a cookie. Implementations must be safe for concurrent use.
type Selector interface {
	Select(c []Candidate, r *http.Request, w http.ResponseWriter) int
}

// LeastConn selects the candidate with the fewest of this gateway's
// attempts in flight (its Load: recent failures count as attempts), breaking ties uniformly at random (reservoir
// sampling), as Caddy's least_conn does with its own request counts. It is
// the default: LLM requests vary in length by orders of magnitude, so load
// follows outstanding requests, not request counts.
type LeastConn struct{}

// Select implements Selector.
func (LeastConn) Select(cs []Candidate, _ *http.Request, _ http.ResponseWriter) int {
	best, ties := -1, 0
	least := int64(-1)
	for i, c := range cs {
		n := c.Load()
		if least == -1 || n < least {
			least, ties = n, 0
		}
		if n == least {
			ties++
			if ties == 1 || rand.IntN(ties) == 0 {
				best = i
			}
		}
	}
	return best
}

// RandomChoose samples Choose candidates uniformly and selects the one with
// the fewest attempts in flight ("power of two choices" when Choose is 2;
// Mitzenmacher 2001), as Caddy's random_choose does.
type RandomChoose struct {
	// Choose is how many candidates to sample; default 2.
	Choose int
}

// Select implements Selector.
func (s RandomChoose) Select(cs []Candidate, _ *http.Request, _ http.ResponseWriter) int {
	k := s.Choose
	if k <= 0 {
		k = 2
	}
	k = min(k, len(cs))
	var buf [8]int
	picked := buf[:0]
	if k > len(buf) {
		picked = make([]int, 0, k)
	}
	for i := range cs {
		if len(picked) < k {
			picked = append(picked, i)
			continue
		}
		if j := rand.IntN(i + 1); j < k {
			picked[j] = i
		}
	}
	best, least := -1, int64(-1)
	for _, i := range picked {
		if n := cs[i].Load(); least == -1 || n < least {
			best, least = i, n
		}
	}
	return best
}

var (
	_ Selector = LeastConn{}
	_ Selector = RandomChoose{}
)
