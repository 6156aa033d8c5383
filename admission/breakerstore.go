package admission

import "github.com/llmproxy/caddy-llm-proxy/breaker"

// TenantBreakerKey is the breaker key of a tenant's breaker in a breaker
// store shared by a fleet: "tenant:" + the tenant id, apart from the
// upstream breakers' keys (dial addresses). Without a store the key is the
// tenant id.
func TenantBreakerKey(tenant string) string { return "tenant:" + tenant }

// brkStoreBox lets an atomic.Pointer hold a breaker.Store (nil inside:
// none).
type brkStoreBox struct{ s breaker.Store }

// SetBreakerStore makes s the store of every tenant breaker from now on
// (nil: none, each gateway keeps its tenants' breakers to itself): with a
// fleet's store (fleet.Breakers) a tenant that trips its breaker on one
// gateway is refused by every gateway, and the fleet's counts decide the
// trip. A breaker that exists already is built again with s on its
// tenant's next request: its counts start from the store's, an open one
// is refused as the store says. Setting the store in effect does nothing.
func (c *Controller) SetBreakerStore(s breaker.Store) {
	if cur := c.brkStore.Load(); cur != nil && cur.s == s {
		return
	}
	c.brkStore.Store(&brkStoreBox{s})
}

// closeBreaker tells a dropped tenant breaker's store that it is gone.
func closeBreaker(b *breaker.Breaker) {
	if b != nil {
		b.Close()
	}
}
