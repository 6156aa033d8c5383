package caddymodule

import (
	"errors"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
	"github.com/tidwall/match"

	"github.com/llmproxy/caddy-llm-proxy/api"
	"github.com/llmproxy/caddy-llm-proxy/proxy"
)

func init() {
	caddy.RegisterModule(MatchModel{})
}

// MatchModel matches requests by the "model" field of their JSON body, so
// that one site can route models to different pools with ordinary handle
// blocks (`@big llm_model llama-70b*`). It reads the body once, bounded by
// max_body and charged to the llm_proxy app's max_buffered_bodies, and
// puts the bytes back as the request's body: the handlers after it read
// the identical body, and llm_proxy takes the bytes (and their parse) as
// they are, without reading or charging them again. The bytes stay
// charged until the request ends.
//
// The model is read as llm_proxy reads it (the API of the request path's
// suffix, package api; Chat's rules on other paths): a body
// that is not one JSON object, repeats "model" (or a field differing from
// it only in case), or has no string model matches no pattern, and so
// does a request whose body llm_proxy does not parse (multipart, binary
// and media types: its body is not read) or that has no body.
//
// A body over max_body ends the request with 413 before any handler runs;
// a body that does not fit max_buffered_bodies within 1s with 503 (a
// matcher cannot set response headers: add Retry-After in handle_errors if
// clients need it); a body that cannot be read with 400. These are
// caddyhttp errors, handled by the site's handle_errors routes.
type MatchModel struct {
	// Patterns are globs, one of which the model must match: '*' matches
	// any sequence of characters, '/' included (model names such as
	// meta-llama/Llama-3.1-70B hold slashes), '?' any one character, and
	// '\' makes the next character literal (github.com/tidwall/match).
	// Matching is case-sensitive, as servers' model names are. At least
	// one is required.
	Patterns []string `json:"patterns,omitempty"`

	// MaxBody is the largest body read, in bytes; a larger one (declared
	// or sent) ends the request with 413. Default: 16MiB
	// (llm_proxy's max_request_body default).
	MaxBody int64 `json:"max_body,omitempty"`

	budget *proxy.BodyBudget
}

// CaddyModule returns the Caddy module information.
func (MatchModel) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.matchers.llm_model",
		New: func() caddy.Module { return new(MatchModel) },
	}
}

// Provision takes the llm_proxy app's body budget.
func (m *MatchModel) Provision(ctx caddy.Context) error {
	appMod, err := ctx.App("llm_proxy")
	if err != nil {
		return err
	}
	m.budget = appMod.(*App).bodies
	return nil
}

// Validate refuses a matcher without patterns or with a negative max_body.
func (m *MatchModel) Validate() error {
	if len(m.Patterns) == 0 {
		return errors.New("llm_model: no patterns")
	}
	for _, p := range m.Patterns {
		if p == "" {
			return errors.New("llm_model: empty pattern")
		}
	}
	if m.MaxBody < 0 {
		return fmt.Errorf("llm_model: negative max_body %d", m.MaxBody)
	}
	return nil
}

func (m *MatchModel) maxBody() int64 {
	if m.MaxBody > 0 {
		return m.MaxBody
	}
	return proxy.DefaultMaxRequestBody
}

// Match reports whether the request's model matches; a request that
// MatchWithError ends with an error does not match.
func (m *MatchModel) Match(r *http.Request) bool {
	ok, _ := m.MatchWithError(r)
	return ok
}

// MatchWithError reads the body (once per request, whatever the number of
// llm_model matchers) and reports whether its model matches one of the
// patterns. The error is a caddyhttp.HandlerError: 413 for a body over
// max_body, 503 when the body budget has no room, 400 when the body cannot
// be read.
func (m *MatchModel) MatchWithError(r *http.Request) (bool, error) {
	if r.Body == nil || r.Body == http.NoBody || !proxy.ParsesBody(r) {
		return false, nil
	}
	body, err := proxy.BufferBody(r.Context(), r, proxy.BodyLimits{Limit: m.maxBody(), Budget: m.budget})
	switch {
	case errors.Is(err, proxy.ErrBodyTooLarge):
		return false, caddyhttp.Error(http.StatusRequestEntityTooLarge, fmt.Errorf("llm_model: %w", err))
	case errors.Is(err, proxy.ErrBodyBudget):
		return false, caddyhttp.Error(http.StatusServiceUnavailable, fmt.Errorf("llm_model: %w", err))
	case err != nil:
		return false, caddyhttp.Error(http.StatusBadRequest, fmt.Errorf("llm_model: %w", err))
	}
	// Read as the path's API reads it (api.ForPath): every API puts the
	// model in the top-level "model".
	info, err := body.Parse(api.ForPath(r.URL.Path))
	if err != nil || info.Model == "" {
		return false, nil
	}
	return m.matches(info.Model), nil
}

// matchEffort bounds the glob's backtracking to this many steps per byte of
// the model (tidwall/match's MatchLimit): the model is the client's, and a
// long one against a pattern of many stars must not cost more than a
// linear scan. A match cut short counts as no match.
const matchEffort = 16

// matches reports whether model matches one of the patterns.
func (m *MatchModel) matches(model string) bool {
	for _, p := range m.Patterns {
		if ok, stopped := match.MatchLimit(model, p, matchEffort); ok && !stopped {
			return true
		}
	}
	return false
}

// UnmarshalCaddyfile sets up the matcher. Syntax:
//
//	llm_model <patterns...> {
//	    max_body <size>
//	}
//
// The block is optional; several llm_model lines of one named matcher
// merge their patterns. Sizes are as Caddy writes them (16MiB, 1GB).
func (m *MatchModel) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	for d.Next() {
		for d.NextArg() {
			m.Patterns = append(m.Patterns, d.Val())
		}
		for d.NextBlock(d.Nesting()) {
			switch d.Val() {
			case "max_body":
				if !d.NextArg() {
					return d.ArgErr()
				}
				size, err := humanize.ParseBytes(d.Val())
				if err != nil || size == 0 || size > 1<<40 {
					return d.Errf("bad max_body %q: want a positive size such as 16MiB", d.Val())
				}
				m.MaxBody = int64(size)
				if d.NextArg() {
					return d.ArgErr()
				}
			default:
				return d.Errf("unrecognized llm_model option %q", d.Val())
			}
		}
	}
	if len(m.Patterns) == 0 {
		return d.Err("llm_model: want at least one model pattern")
	}
	return nil
}

// Interface guards
var (
	_ caddy.Provisioner                 = (*MatchModel)(nil)
	_ caddy.Validator                   = (*MatchModel)(nil)
	_ caddyhttp.RequestMatcherWithError = (*MatchModel)(nil)
	_ caddyfile.Unmarshaler             = (*MatchModel)(nil)
)
