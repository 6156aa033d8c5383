package admission

import (
	"errors"
	"fmt"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// slowMark is the SlowTTFT of a tenant breaker whose tier has a SlowRatio
// rule. The tier's objectives depend on each request's prompt size, which a
// breaker's single SlowTTFT cannot express, so Settle decides slowness
// itself and reports a slow call as a success with a TTFT above slowMark
// (and every other success with TTFT 0, never slow).
const slowMark = time.Nanosecond

// limits are a tenant's effective limits: its tier's, with its overrides.
type limits struct{ maxConc, rpm, tpm int }

// tierInfo is a validated tier with defaults applied and its tenant breaker
// settings. Immutable; replaced on SetConfig.
type tierInfo struct {
	Tier
	lim limits
	// brk is the tenant breaker's settings; nil when the tier has none.
	brk *breaker.Settings
	// slowRatio: brk counts slow calls for a SlowRatio rule (slowMark).
	slowRatio bool
}

// tenantInfo is a configured tenant: its tier and overrides.
type tenantInfo struct {
	cfg  TenantConfig
	tier *tierInfo
}

// snapshot is one Config, resolved. Immutable; the Controller swaps it.
type snapshot struct {
	cfg     Config
	tiers   map[string]*tierInfo
	tenants map[string]*tenantInfo
	def     *tierInfo // DefaultTier; nil: unlisted tenants have none
}

// hasSLO reports whether t has an objective that makes slow calls.
func (t *Tier) hasSLO() bool { return t.TTFTSLO > 0 || t.QueueWaitSLO > 0 }

// tenantBreakerSettings returns the breaker settings of t's tenants, nil
// when they have no breaker (nil Breaker and no objective).
func tenantBreakerSettings(t *Tier) (s *breaker.Settings, slowRatio bool) {
	if t.Breaker == nil && !t.hasSLO() {
		return nil, false
	}
	var bs breaker.Settings
	if t.Breaker != nil {
		bs = *t.Breaker
	}
	bs.SlowTTFT = 0
	// A tenant's own failures are no sample of a pool: any run of them
	// trips, amid successes or not.
	bs.AnyRun = true
	if bs.SlowRatio > 0 && t.hasSLO() {
		bs.SlowTTFT = slowMark
		slowRatio = true
	} else {
		bs.SlowRatio = 0
	}
	return &bs, slowRatio
}

func (cfg Config) validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	names := make(map[string]bool, len(cfg.Tiers))
	for i := range cfg.Tiers {
		t := &cfg.Tiers[i]
		at := fmt.Sprintf("tiers[%d] %q", i, t.Name)
		switch {
		case t.Name == "":
			bad("tiers[%d]: name: empty", i)
		case names[t.Name]:
			bad("%s: name: duplicate tier", at)
		}
		names[t.Name] = true
		for _, f := range []struct {
			name string
			v    int
		}{{"max_concurrent", t.MaxConcurrent}, {"rpm", t.RPM}, {"tpm", t.TPM}, {"default_max_tokens", t.DefaultMaxTokens}, {"queue", t.Queue}} {
			if f.v < 0 {
				bad("%s: %s %d: must not be negative", at, f.name, f.v)
			}
		}
		for _, f := range []struct {
			name string
			v    time.Duration
		}{{"queue_timeout", t.QueueTimeout}, {"ttft_slo", t.TTFTSLO}, {"per_1k_prompt_tokens", t.TTFTPer1kPrompt}, {"queue_wait_slo", t.QueueWaitSLO}} {
			if f.v < 0 {
				bad("%s: %s %s: must not be negative", at, f.name, f.v)
			}
		}
		if t.TTFTPer1kPrompt > 0 && t.TTFTSLO == 0 {
			bad("%s: per_1k_prompt_tokens %s: needs ttft_slo", at, t.TTFTPer1kPrompt)
		}
		if b := t.Breaker; b != nil {
			if b.SlowTTFT != 0 {
				bad("%s: breaker slow_ttft %s: tenant breakers take their objectives from ttft_slo and queue_wait_slo", at, b.SlowTTFT)
			}
			if b.SlowRatio != 0 && !t.hasSLO() {
				bad("%s: breaker slow_ratio %v: needs ttft_slo or queue_wait_slo", at, b.SlowRatio)
			}
			if b.ActiveProbing {
				bad("%s: breaker active_probing: tenant breakers are probed by the tenant's own requests", at)
			}
			if s, _ := tenantBreakerSettings(t); s != nil {
				if err := s.Validate(); err != nil {
					bad("%s: breaker: %w", at, err)
				}
			}
		}
	}
	defTier := cfg.DefaultTier
	if defTier != "" && !names[defTier] {
		bad("default_tier %q: no such tier", defTier)
	}
	if defTier == "" && names["default"] {
		defTier = "default"
	}
	if cfg.UnknownTier != "" && !names[cfg.UnknownTier] {
		bad("unknown tier %q: no such tier", cfg.UnknownTier)
	}
	ids := make(map[string]bool, len(cfg.Tenants))
	for i, tc := range cfg.Tenants {
		at := fmt.Sprintf("tenants[%d] %q", i, tc.ID)
		switch {
		case tc.ID == "":
			bad("tenants[%d]: id: empty", i)
		case ids[tc.ID]:
			bad("%s: id: duplicate tenant", at)
		}
		ids[tc.ID] = true
		switch {
		case tc.Tier != "" && !names[tc.Tier]:
			bad("%s: tier %q: no such tier", at, tc.Tier)
		case tc.Tier == "" && defTier == "":
			bad("%s: tier: none given and no default tier", at)
		}
		for _, f := range []struct {
			name string
			v    int
		}{{"max_concurrent", tc.MaxConcurrent}, {"rpm", tc.RPM}, {"tpm", tc.TPM}} {
			if f.v < 0 {
				bad("%s: %s %d: must not be negative", at, f.name, f.v)
			}
		}
	}
	return errors.Join(errs...)
}

// newSnapshot resolves a validated cfg.
func newSnapshot(cfg Config) *snapshot {
	s := &snapshot{
		cfg:     cfg,
		tiers:   make(map[string]*tierInfo, len(cfg.Tiers)),
		tenants: make(map[string]*tenantInfo, len(cfg.Tenants)),
	}
	for _, t := range cfg.Tiers {
		if t.DefaultMaxTokens == 0 {
			t.DefaultMaxTokens = DefaultMaxTokens
		}
		if t.Queue == 0 {
			t.Queue = DefaultQueue
		}
		if t.QueueTimeout == 0 {
			t.QueueTimeout = DefaultQueueTimeout
		}
		if t.Breaker != nil {
			b := *t.Breaker // the caller's Settings may change later
			t.Breaker = &b
		}
		ti := &tierInfo{Tier: t, lim: limits{t.MaxConcurrent, t.RPM, t.TPM}}
		ti.brk, ti.slowRatio = tenantBreakerSettings(&ti.Tier)
		s.tiers[t.Name] = ti
	}
	switch {
	case cfg.DefaultTier != "":
		s.def = s.tiers[cfg.DefaultTier]
	default:
		s.def = s.tiers["default"]
	}
	for _, tc := range cfg.Tenants {
		ti := s.def
		if tc.Tier != "" {
			ti = s.tiers[tc.Tier]
		}
		s.tenants[tc.ID] = &tenantInfo{cfg: tc, tier: ti}
	}
	return s
}

// resolve returns the effective tier and limits of a request of tenant
// with tier override tier ("" none): the override's tier, else the
// tenant's configured tier, else the default tier; with the tenant's own
// overrides on top whichever tier applies. ok is false when there is none.
func (s *snapshot) resolve(tenant, tier string) (*tierInfo, limits, bool) {
	tc := s.tenants[tenant]
	var ti *tierInfo
	switch {
	case tier != "":
		ti = s.tiers[tier]
	case tc != nil:
		ti = tc.tier
	default:
		ti = s.def
	}
	if ti == nil {
		return nil, limits{}, false
	}
	lim := ti.lim
	if tc != nil {
		if tc.cfg.MaxConcurrent > 0 {
			lim.maxConc = tc.cfg.MaxConcurrent
		}
		if tc.cfg.RPM > 0 {
			lim.rpm = tc.cfg.RPM
		}
		if tc.cfg.TPM > 0 {
			lim.tpm = tc.cfg.TPM
		}
	}
	return ti, lim, true
}

// effective returns ti's Tier with lim in place of its limits.
func (ti *tierInfo) effective(lim limits) Tier {
	t := ti.Tier
	t.MaxConcurrent, t.RPM, t.TPM = lim.maxConc, lim.rpm, lim.tpm
	return t
}

// pinned reports whether tenant's state is kept whatever the bound on
// tenant states: configured tenants and UnknownTenant.
func (s *snapshot) pinned(tenant string) bool {
	return tenant == UnknownTenant || s.tenants[tenant] != nil
}
