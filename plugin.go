// Package caddyllmproxy is the import path that xcaddy builds into Caddy:
// importing it registers the llm_proxy modules. The code lives in
// ./caddymodule (Caddy glue) and the packages it uses.
package caddyllmproxy

import (
	// Registers http.handlers.llm_proxy and its Caddyfile directive.
	_ "github.com/llmproxy/caddy-llm-proxy/caddymodule"
)
