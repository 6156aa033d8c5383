package caddymodule

import (
	"fmt"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// Two sites on two ports (so two Caddy servers, which Caddy provisions in
// map order, at random) in front of one upstream with different breaker
// settings. Which site's breaker has the plain key "<upstream>" must be a
// function of the config: loading the same config again, or on another
// gateway of a fleet, names the breakers alike (else a fleet's gateways
// share one Redis key between two sites' breakers, and an operator's
// POST to "<upstream>~<policy>" hits the other site after a restart).
// Before, the primary policy was the last provisioned handler's: over ten
// loads of this config it went to either site.
func TestPlainBreakerKeyDoesNotDependOnProvisionOrder(t *testing.T) {
	m := newMockVLLM(t)
	dial := strings.TrimPrefix(m.URL, "http://")
	site := func(listen, name string, failures int) string {
		return fmt.Sprintf("http://%s {\n\tllm_proxy %s {\n\t\tname %s\n\t\tbreaker {\n\t\t\tconsecutive_failures %d\n\t\t}\n\t}\n}\n",
			listen, dial, name, failures)
	}
	src := "{\n\tadmin off\n\tpersist_config off\n}\n" + site(freePort(t), "site-a", 2) + site(freePort(t), "site-b", 10)
	cfg, err := adapt(t, src)
	if err != nil {
		t.Fatalf("adapt: %v\n%s", err, src)
	}
	t.Cleanup(func() { _ = caddy.Stop() })
	seen := map[string]int{}
	for range 10 {
		if err := caddy.Load(cfg, true); err != nil {
			t.Fatalf("load: %v", err)
		}
		plain := getBreaker(t, dial)
		seen[strings.Join(plain.Handlers, ",")]++
	}
	if len(seen) != 1 {
		t.Fatalf("the plain key %q served, over ten loads of one config: %v; want one site every time", dial, seen)
	}
}
