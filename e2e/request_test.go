package e2e

import (
	"bytes"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/llmproxy/caddy-llm-proxy/internal/mockllm"
)

// checkInvalidRequest checks a gateway-written refusal: the status, JSON
// content type, OpenAI's error shape with type invalid_request_error.
func checkInvalidRequest(t *testing.T, resp *plainResponse, status int) {
	t.Helper()
	if resp.Status != status {
		t.Fatalf("status %d, want %d: %s", resp.Status, status, resp.Body)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type %q, want application/json", ct)
	}
	msg, typ, code := openAIError(t, resp.Body)
	if typ != "invalid_request_error" {
		t.Errorf("error type %q, want invalid_request_error", typ)
	}
	t.Logf("%d: code %q, message %q", status, code, msg)
}

// sendBody posts body with a declared Content-Length, or chunked (no
// Content-Length) when chunked is true.
func sendBody(t *testing.T, c *http.Client, url string, body []byte, chunked bool) *plainResponse {
	t.Helper()
	ctx := testContext(t, 30*time.Second)
	var r io.Reader = bytes.NewReader(body)
	if chunked {
		r = io.MultiReader(bytes.NewReader(body)) // hides the length
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, r)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if chunked {
		req.ContentLength = -1
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("POST: %v", err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading response: %v", err)
	}
	return &plainResponse{Status: resp.StatusCode, Header: resp.Header, Body: b}
}

// TestOversizedBodyIs413WithoutUpstreamCall: a body over max_request_body
// is refused with 413 before any upstream call, whether its
// Content-Length says so or it arrives chunked; a body of exactly the
// limit goes through.
func TestOversizedBodyIs413WithoutUpstreamCall(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{Behavior: mockllm.Behavior{Tokens: 2, TokenInterval: mockllm.NoDelay}})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet)+" {\n\t\tmax_request_body 64KiB\n\t}")
	c := newClient(t)
	url := gw.URL + "/v1/chat/completions"
	over := bodyOfSize(t, 128<<10)

	t.Run("content-length", func(t *testing.T) {
		checkInvalidRequest(t, sendBody(t, c, url, over, false), http.StatusRequestEntityTooLarge)
	})
	t.Run("chunked", func(t *testing.T) {
		checkInvalidRequest(t, sendBody(t, c, url, over, true), http.StatusRequestEntityTooLarge)
	})
	// Far over the limit: more than net/http discards after an unread
	// body, so the connection closes under the upload; the client must
	// still get the 413.
	t.Run("4MiB-content-length", func(t *testing.T) {
		checkInvalidRequest(t, sendBody(t, c, url, bodyOfSize(t, 4<<20), false), http.StatusRequestEntityTooLarge)
	})
	t.Run("4MiB-chunked", func(t *testing.T) {
		checkInvalidRequest(t, sendBody(t, c, url, bodyOfSize(t, 4<<20), true), http.StatusRequestEntityTooLarge)
	})
	t.Run("one-byte-over-chunked", func(t *testing.T) {
		checkInvalidRequest(t, sendBody(t, c, url, bodyOfSize(t, 64<<10+1), true), http.StatusRequestEntityTooLarge)
	})
	if n := fleetRequests(fleet); n != 0 {
		t.Errorf("the fleet got %d requests for oversized bodies, want 0", n)
	}
	t.Run("at-the-limit", func(t *testing.T) {
		for _, chunked := range []bool{false, true} {
			resp := sendBody(t, c, url, bodyOfSize(t, 64<<10), chunked)
			if resp.Status != http.StatusOK {
				t.Errorf("chunked=%v: a body of exactly max_request_body got %d, want 200: %.200s", chunked, resp.Status, resp.Body)
			}
		}
		if n := fleetRequests(fleet); n != 2 {
			t.Errorf("the fleet got %d requests, want 2", n)
		}
	})
}

// TestInvalidJSONIs400WithoutUpstreamCall: a JSON endpoint refuses a body
// that is not a JSON object with 400 before any upstream call.
func TestInvalidJSONIs400WithoutUpstreamCall(t *testing.T) {
	t.Parallel()
	fleet := startFleet(t, mockllm.FleetConfig{})
	gw := startGateway(t, "\tllm_proxy "+upstreams(fleet))
	c := newClient(t)
	for name, body := range map[string]string{
		"truncated":     `{"model":"mock-llama","messages":[{"role":"user","content":"hi"}`,
		"not-an-object": `["model","mock-llama"]`,
		"wrong-type":    `{"model":"mock-llama","stream":"yes","messages":[]}`,
	} {
		t.Run(name, func(t *testing.T) {
			checkInvalidRequest(t, sendBody(t, c, gw.URL+"/v1/chat/completions", []byte(body), false), http.StatusBadRequest)
		})
	}
	if n := fleetRequests(fleet); n != 0 {
		t.Errorf("the fleet got %d requests for invalid JSON, want 0", n)
	}
}
