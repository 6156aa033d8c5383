package upstream

import "github.com/llmproxy/caddy-llm-proxy/breaker"

// closeBreakers tells each dropped breaker's store that it is no longer
// used (breaker.Close): a fleet store (breaker.Fleet) stops pushing the
// fleet's verdicts to it. Callers drop the breakers from the entry first
// and call this without the entry's lock, since a store may push, and a
// push delivers the breaker's transitions to the entry's listener.
func closeBreakers[K comparable](m map[K]*breaker.Breaker) {
	for _, b := range m {
		b.Close()
	}
}
