package caddymodule

import (
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
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
//	    }
//	}
//
// The block has no settings yet: tenants, tiers and the fleet connection
// come here in later versions. Any subdirective is an error.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		return d.Errf("unrecognized llm_proxy global option %q", d.Val())
	}
	return nil
}

var _ caddyfile.Unmarshaler = (*App)(nil)
