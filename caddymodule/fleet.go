package caddymodule

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/fleet"
	"github.com/llmproxy/caddy-llm-proxy/internal/registry"
)

// FleetConfig connects the gateways of a fleet through Redis (global option
// `fleet redis <url> { … }`). The connection is opened when the config
// starts — never by a config that fails to load — and kept across reloads
// while these settings stay the same. A Redis that cannot be reached does
// not fail the config: the gateway runs in local mode and joins the fleet
// when Redis answers.
type FleetConfig struct {
	// Redis is the server's URL: redis://[:password@]host:port[/db],
	// rediss://… for TLS, redis+sentinel://host:port[,host:port]/<master>[/db]
	// (the URL's password, if any, is the Sentinels'), or
	// redis+cluster://[:password@]host:port[,host:port] (a Redis Cluster,
	// db 0). Placeholders such as
	// {env.REDIS_URL} are replaced when the config loads. Required.
	Redis string `json:"redis"`

	// Password authenticates to Redis (the master under Sentinel); give it
	// as {env.NAME} to keep it out of the config. Default: none, or the
	// URL's.
	Password string `json:"password,omitempty"`

	// DB is the database number. Default: 0, or the URL's path.
	DB int `json:"db,omitempty"`

	// KeyPrefix starts every key the gateway writes. Default "llmproxy:".
	KeyPrefix string `json:"key_prefix,omitempty"`

	// OpTimeout bounds each Redis operation, connecting included: the most
	// any request ever waits on Redis. At most refresh / 2. Default 50ms.
	OpTimeout caddy.Duration `json:"op_timeout,omitempty"`

	// Refresh is the interval of the background work: the instance
	// heartbeat, the check that ends local mode (and the bulk refresh of
	// shared state). Default 1s.
	Refresh caddy.Duration `json:"refresh,omitempty"`

	// InstanceID names this gateway in the fleet. Default: the hostname, a
	// dash and 6 random hex digits (kept across reloads while the fleet
	// settings are unchanged).
	InstanceID string `json:"instance_id,omitempty"`

	// ExpectedInstances is the fleet's usual size: in local mode each
	// gateway enforces fleet-wide limits ÷ this. Default 1.
	ExpectedInstances int `json:"expected_instances,omitempty"`

	// MinReporters is how many distinct gateways must report an upstream's
	// failures before its breaker opens fleet-wide. Default 1.
	MinReporters int `json:"min_reporters,omitempty"`
}

// config resolves the placeholders and checks the settings. The result is
// what identifies the connection across reloads (defaults not applied, so
// a generated instance id is not part of it).
func (fc *FleetConfig) config() (fleet.Config, error) {
	repl := caddy.NewReplacer()
	cfg := fleet.Config{
		URL:               repl.ReplaceKnown(fc.Redis, ""),
		Password:          repl.ReplaceKnown(fc.Password, ""),
		DB:                fc.DB,
		KeyPrefix:         fc.KeyPrefix,
		OpTimeout:         time.Duration(fc.OpTimeout),
		Refresh:           time.Duration(fc.Refresh),
		InstanceID:        repl.ReplaceKnown(fc.InstanceID, ""),
		ExpectedInstances: fc.ExpectedInstances,
		MinReporters:      fc.MinReporters,
	}
	if cfg.URL == "" {
		if fc.Redis != "" {
			return cfg, fmt.Errorf("llm_proxy: fleet: redis %s is empty", fc.Redis)
		}
		return cfg, fmt.Errorf("llm_proxy: fleet: no redis URL")
	}
	if fc.Password != "" && cfg.Password == "" {
		return cfg, fmt.Errorf("llm_proxy: fleet: password %s is empty", placeholderName(fc.Password))
	}
	if err := cfg.Defaults().Validate(); err != nil {
		return cfg, fmt.Errorf("llm_proxy: %w", err)
	}
	return cfg, nil
}

// fleetKey identifies a connection by its settings.
func fleetKey(cfg fleet.Config) string {
	b, _ := json.Marshal(cfg)
	h := sha256.Sum256(b)
	return hex.EncodeToString(h[:])
}

// startFleet takes this config's reference to its connection
// (shared.fleets, one per distinct settings), opening it when no running
// config has it: a reload with the same settings keeps the connection (and
// the generated instance id), and the last config to stop closes it. Its
// breaker and limit stores live as long as the connection, under the same
// key and claims.
func (a *App) startFleet() error {
	if a.fleet == nil { // no fleet configured (Provision made the slot)
		return nil
	}
	a.fleetClaims = new(registry.Claims)
	c, err := shared.fleets.Acquire(a.fleetClaims, fleetKey(a.fleetCfg), func() (*fleet.Client, error) {
		return fleet.Open(a.fleetCfg, fleetObserver{}, fleetLogger())
	}, nil)
	if err != nil {
		a.fleetClaims.Release()
		a.fleetClaims = nil
		return fmt.Errorf("llm_proxy: fleet: %w", err)
	}
	a.fleet.Store(c)
	// The fleet's breaker store lives as long as its connection (the
	// claims drop it first): the upstream breakers share their counts and
	// open state through it (Start gives it to the registry).
	bs, err := shared.fleetBreakers.Acquire(a.fleetClaims, fleetKey(a.fleetCfg), func() (*fleet.Breakers, error) {
		return fleet.NewBreakers(c, fleet.BreakersOptions{OnDrop: breakerReportDropped, OnLease: probeLeaseCounted}), nil
	}, nil)
	if err != nil {
		return fmt.Errorf("llm_proxy: fleet: %w", err)
	}
	a.fleet.breakers.Store(bs)
	// The tenants' limits are counted in Redis through the connection's
	// limit store (the tenancy's fleet.FailOpenLimits reads it from the slot).
	l, err := shared.fleetLimits.Acquire(a.fleetClaims, fleetKey(a.fleetCfg), func() (*fleet.Limits, error) {
		return fleet.NewLimits(c, fleet.LimitsConfig{})
	}, nil)
	if err != nil {
		return fmt.Errorf("llm_proxy: fleet: %w", err)
	}
	a.fleet.limits.Store(l)
	return nil
}

// breakerReportDropped counts a breaker report that found the store's
// queue full (the worker behind a slow Redis).
func breakerReportDropped(op string) {
	initMetrics()
	metrics.fleetErrors.WithLabelValues(op, "queue_full").Inc()
}

// fleetSlot holds a running config's connection and its breaker and limit
// stores: written by Start, read by the admin API, the metrics and the
// tenants' limit store.
type fleetSlot struct {
	atomic.Pointer[fleet.Client]
	breakers atomic.Pointer[fleet.Breakers]
	limits   atomic.Pointer[fleet.Limits]
}

// breakerStore is the breaker store this config gives the upstream
// registry: the fleet's once started, nil without a fleet.
func (a *App) breakerStore() breaker.Store {
	if a == nil || a.fleet == nil {
		return nil
	}
	if bs := a.fleet.breakers.Load(); bs != nil {
		return bs
	}
	return nil
}

// liveBreakerStore is the fleet breaker store the upstream breakers use
// now, nil for none.
func liveBreakerStore() *fleet.Breakers {
	bs, _ := shared.upstreams.BreakerStore().(*fleet.Breakers)
	return bs
}

// stopFleet drops this config's reference; the last one closes the
// connection.
func (a *App) stopFleet() {
	if a.fleetClaims != nil {
		a.fleetClaims.Release()
		a.fleetClaims = nil
	}
}

// liveFleet is the connection of the newest running config, nil when that
// config has no fleet (or none runs).
func liveFleet() *fleet.Client {
	if c := shared.live.Newest(); c != nil {
		return c.Fleet
	}
	return nil
}

// fleetView is GET /llm_proxy/fleet.
type fleetView struct {
	// Mode is "fleet" (Redis in use), "local" (Redis away: local state)
	// or "off" (no fleet configured).
	Mode       string           `json:"mode"`
	InstanceID string           `json:"instance_id,omitempty"`
	Since      *time.Time       `json:"since,omitempty"`
	Instances  []fleet.Instance `json:"instances"`
	Error      string           `json:"error,omitempty"`
}

// fleetObserver feeds the connection's operations into the metrics.
type fleetObserver struct{}

func (fleetObserver) OpDone(op string, took time.Duration, kind fleet.ErrorKind) {
	initMetrics()
	metrics.fleetOps.WithLabelValues(op).Observe(took.Seconds())
	if kind != "" {
		metrics.fleetErrors.WithLabelValues(op, string(kind)).Inc()
	}
}

// fleetLogger writes through the newest running config's llm_proxy
// logger, so a connection kept across reloads logs where the current
// config says (Caddy's default logger before any config runs).
func fleetLogger() *zap.Logger {
	return zap.New(newestCore{}).Named("llm_proxy.fleet")
}

// newestCore is a zapcore.Core that delegates to the newest app's logger.
type newestCore struct{ fields []zapcore.Field }

func (newestCore) target() zapcore.Core {
	if l := shared.live.Logger(); l != nil {
		return l.Core()
	}
	return caddy.Log().Core()
}

func (c newestCore) with() zapcore.Core {
	t := c.target()
	if len(c.fields) > 0 {
		t = t.With(c.fields)
	}
	return t
}

func (c newestCore) Enabled(l zapcore.Level) bool { return c.target().Enabled(l) }

func (c newestCore) With(f []zapcore.Field) zapcore.Core {
	return newestCore{fields: append(slices.Clip(c.fields), f...)}
}

func (c newestCore) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	return c.with().Check(e, ce)
}

func (c newestCore) Write(e zapcore.Entry, f []zapcore.Field) error { return c.with().Write(e, f) }

func (c newestCore) Sync() error { return c.target().Sync() }

// fleetMode names the mode of a connection for the admin API.
func fleetMode(c *fleet.Client) string {
	switch {
	case c == nil:
		return "off"
	case c.Degraded():
		return "local"
	}
	return "fleet"
}
