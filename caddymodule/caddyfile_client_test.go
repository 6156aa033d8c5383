package caddymodule

import (
	"strings"
	"testing"
)

// TestUpstreamClientAdapts: upstream_client net_http reaches the handler's
// JSON; an unknown value, a missing one or a second line is refused.
func TestUpstreamClientAdapts(t *testing.T) {
	out, err := adapt(t, ":8080 {\n\tllm_proxy 127.0.0.1:9000 {\n\t\tupstream_client net_http\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(out), `"upstream_client":"net_http"`) {
		t.Fatalf("adapted JSON lacks upstream_client: %s", out)
	}
	for block, want := range map[string]string{
		"upstream_client curl":                                  `upstream_client "curl": want builtin or net_http`,
		"upstream_client":                                       "wrong argument count",
		"upstream_client net_http extra":                        "wrong argument count",
		"upstream_client builtin\n\t\tupstream_client net_http": "upstream_client already specified",
	} {
		_, err := adapt(t, ":8080 {\n\tllm_proxy 127.0.0.1:9000 {\n\t\t"+block+"\n\t}\n}\n")
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%q: err %v, want %q", block, err, want)
		}
	}
}
