package caddymodule

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"
)

// siteRoute is one route of sitesConfig: requests under /<name>/ go to an
// llm_proxy handler (max_attempts 1) with the breaker given as JSON.
type siteRoute struct{ name, breaker string }

// sitesConfig is a JSON config (admin off) of one server on listen whose
// routes, in their order, are sites, each in front of dial. Routes of one
// server are provisioned in order, so the last site is provisioned last.
func sitesConfig(listen, dial string, sites ...siteRoute) []byte {
	routes := make([]string, len(sites))
	for i, s := range sites {
		routes[i] = `{"match":[{"path":["/` + s.name + `/*"]}],"handle":[` +
			`{"handler":"llm_proxy","max_attempts":1,"upstreams":[{"dial":"` + dial + `"}],"breaker":` + s.breaker + `}]}`
	}
	return []byte(`{"admin":{"disabled":true,"config":{"persist":false}},"apps":{"http":{"servers":{"s":{"listen":["` + listen +
		`"],"automatic_https":{"disable":true},"routes":[` + strings.Join(routes, ",") + `]}}}}}`)
}

// postSite sends a chat completion to site's route through c and returns
// the status.
func postSite(t *testing.T, c *http.Client, listen, site string) int {
	t.Helper()
	post := func() (*http.Response, error) {
		return c.Post("http://"+listen+"/"+site+"/v1/chat/completions", "application/json",
			strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`))
	}
	resp, err := post()
	for try := 1; err != nil && handOffLost(err) && try < 5; try++ {
		// Caddy's reload binds the new listener beside the old one
		// (SO_REUSEPORT) and returns once the old server has begun, not
		// finished, its shutdown: a connection the kernel queued on the old
		// socket in that moment is reset, or closed unanswered, before any
		// handler sees the request (seen in loaded make test runs). The
		// request never reached a handler, so it is sent again.
		time.Sleep(time.Duration(try) * 5 * time.Millisecond)
		resp, err = post()
	}
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// handOffLost reports whether err is how a connection lost in a reload's
// listener hand-off fails: EOF before any response, or a reset or refusal.
func handOffLost(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.ECONNREFUSED)
}
