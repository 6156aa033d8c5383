package caddymodule

import (
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("llm_proxy", parseGlobalOption)
}

// parseGlobalOption parses the global option block into the llm_proxy app.
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	if existing != nil {
		return nil, d.Err("llm_proxy global option already specified")
	}
	app := new(App)
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "llm_proxy", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile sets up the app from the global option. Syntax:
//
//	{
//	    llm_proxy {
//	        tenants {
//	            key <key>|sha256:<hex>|{env.X} <tenant> [tier <tier>]
//	            keys_file <path>
//	            header <name> trusted_proxies <ranges...>
//	            unknown deny|<tier>
//	        }
//	        tier <name> {
//	            priority <int>
//	            max_concurrent <n>
//	            rpm <n>
//	            tpm <n>
//	            default_max_tokens <n>
//	            queue <n>
//	            queue_timeout <duration>
//	            ttft_slo <duration> [per_1k_prompt_tokens <duration>]
//	            queue_wait_slo <duration>
//	            breaker { … }
//	        }
//	        tenant <id> {
//	            tier <name>
//	            max_concurrent <n>
//	            rpm <n>
//	            tpm <n>
//	        }
//	        metrics_tenant_label
//	        max_buffered_bodies <size>
//	        fleet redis <url> {
//	            password <secret>|{env.X}
//	            db <n>
//	            key_prefix <prefix>
//	            op_timeout <duration>
//	            refresh <duration>
//	            instance_id <id>
//	            expected_instances <n>
//	            min_reporters <n>
//	        }
//	    }
//	}
//
// tier and tenant may repeat. The tier's breaker block takes the upstream
// breaker's grammar (probe and scope excepted). fleet's block is optional;
// its URL is redis://, rediss:// (TLS),
// redis+sentinel://host:port[,host:port]/<master> or
// redis+cluster://host:port[,host:port].
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "tenants":
			if a.Tenants != nil {
				return d.Err("tenants already specified")
			}
			a.Tenants = new(TenantsConfig)
			if err := parseTenants(d, a.Tenants); err != nil {
				return err
			}
		case "tier":
			t, err := parseTier(d)
			if err != nil {
				return err
			}
			for _, o := range a.Tiers {
				if o.Name == t.Name {
					return d.Errf("tier %s already specified", t.Name)
				}
			}
			a.Tiers = append(a.Tiers, t)
		case "tenant":
			t, err := parseTenant(d)
			if err != nil {
				return err
			}
			for _, o := range a.TenantOverrides {
				if o.ID == t.ID {
					return d.Errf("tenant %s already specified", t.ID)
				}
			}
			a.TenantOverrides = append(a.TenantOverrides, t)
		case "fleet":
			if a.Fleet != nil {
				return d.Err("fleet already specified")
			}
			a.Fleet = new(FleetConfig)
			if err := parseFleet(d, a.Fleet); err != nil {
				return err
			}
		case "max_buffered_bodies":
			if !d.NextArg() {
				return d.ArgErr()
			}
			size, err := humanize.ParseBytes(d.Val())
			if err != nil || size == 0 || size > 1<<40 {
				return d.Errf("bad max_buffered_bodies %q: want a positive size such as 256MiB", d.Val())
			}
			a.MaxBufferedBodies = int64(size)
			if d.NextArg() {
				return d.ArgErr()
			}
		case "metrics_tenant_label":
			if d.NextArg() {
				return d.ArgErr()
			}
			a.MetricsTenantLabel = true
		default:
			return d.Errf("unrecognized llm_proxy global option %q", d.Val())
		}
	}
	return nil
}

var _ caddyfile.Unmarshaler = (*App)(nil)
