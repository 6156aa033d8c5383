package caddymodule

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
)

// parseHeaderOp parses one header_up or header_down line (the dispenser is
// on the subdirective) into *hh, with reverse_proxy's grammar and Caddy's
// own helper:
//
//	header_up   [+|-]<field> [<value|regexp> [<replacement>]]
//	header_down [+|-]<field> [<value|regexp> [<replacement>]]
func parseHeaderOp(d *caddyfile.Dispenser, hh **headers.Handler) error {
	up := d.Val() == "header_up"
	if *hh == nil {
		*hh = new(headers.Handler)
	}
	var ops *headers.HeaderOps
	if up {
		if (*hh).Request == nil {
			(*hh).Request = new(headers.HeaderOps)
		}
		ops = (*hh).Request
	} else {
		if (*hh).Response == nil {
			(*hh).Response = &headers.RespHeaderOps{HeaderOps: new(headers.HeaderOps)}
		}
		ops = (*hh).Response.HeaderOps
	}
	var err error
	switch args := d.RemainingArgs(); len(args) {
	case 1:
		err = headers.CaddyfileHeaderOp(ops, args[0], "", nil)
	case 2:
		err = headers.CaddyfileHeaderOp(ops, args[0], args[1], nil)
	case 3:
		err = headers.CaddyfileHeaderOp(ops, args[0], args[1], &args[2])
	default:
		return d.ArgErr()
	}
	if err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// parseFlag parses a subdirective that takes no argument.
func parseFlag(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.ArgErr()
	}
	return nil
}
