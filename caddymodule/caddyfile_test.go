package caddymodule

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	"github.com/llmproxy/caddy-llm-proxy/upstream"
)

var update = flag.Bool("update", false, "rewrite the golden JSON files of the adapt tests")

// adapt runs the Caddyfile adapter, as `caddy adapt` does.
func adapt(t testing.TB, src string) ([]byte, error) {
	t.Helper()
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(src), map[string]any{"filename": "Caddyfile"})
	return out, err
}

func indentJSON(t *testing.T, b []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "\t"); err != nil {
		t.Fatalf("indent: %v", err)
	}
	buf.WriteByte('\n')
	return buf.Bytes()
}

// TestExamplesAdaptAndProvision adapts every file in caddyfile-examples/,
// compares the JSON with its golden file, and provisions the result the way
// `caddy validate` does, so an example that would not run fails here.
func TestExamplesAdaptAndProvision(t *testing.T) {
	files, err := filepath.Glob("../caddyfile-examples/*.Caddyfile")
	if err != nil || len(files) == 0 {
		t.Fatalf("no examples found: %v", err)
	}
	for _, f := range files {
		name := strings.TrimSuffix(filepath.Base(f), ".Caddyfile")
		t.Run(name, func(t *testing.T) {
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			out, err := adapt(t, string(src))
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			got := indentJSON(t, out)
			golden := filepath.Join("testdata", "adapt", name+".json")
			if *update {
				if err := os.WriteFile(golden, got, 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(golden)
			if err != nil {
				t.Fatalf("missing golden file (run go test -run TestExamples -update): %v", err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("adapted JSON differs from %s:\n got: %s\nwant: %s", golden, got, want)
			}
			if err := caddy.Validate(mustConfig(t, out)); err != nil {
				t.Errorf("provisioning the adapted config: %v", err)
			}
		})
	}
}

func mustConfig(t *testing.T, b []byte) *caddy.Config {
	t.Helper()
	var cfg caddy.Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		t.Fatal(err)
	}
	return &cfg
}

// TestCaddyfileErrors checks every error the llm_proxy parser reports, each
// with the file and line of the offending token.
func TestCaddyfileErrors(t *testing.T) {
	cases := []struct {
		name, body, want string
	}{
		{"unknown subdirective", "llm_proxy 127.0.0.1:9000 {\n\tbogus 1\n}", `at Caddyfile:3|unrecognized llm_proxy subdirective "bogus"`},
		{"to without args", "llm_proxy {\n\tto\n}", "at Caddyfile:3|wrong argument count"},
		{"bad upstream scheme", "llm_proxy ftp://127.0.0.1:9000", `at Caddyfile:2|upstream "127.0.0.1:9000": unsupported scheme "ftp"`},
		{"upstream with path", "llm_proxy http://127.0.0.1:9000/v1", `at Caddyfile:2|upstream "http://127.0.0.1:9000/v1": an upstream address has no path`},
		{"port range", "llm_proxy 127.0.0.1:9000-9002", `at Caddyfile:2|upstream "127.0.0.1:9000-9002": must be exactly one host and port`},
		{"mixed schemes", "llm_proxy http://127.0.0.1:9000 https://127.0.0.1:9001", `at Caddyfile:2|upstreams mix schemes`},
		{"dynamic without source", "llm_proxy {\n\tdynamic\n}", "at Caddyfile:3|wrong argument count"},
		{"dynamic twice", "llm_proxy {\n\tdynamic a example.internal 8000\n\tdynamic a example.internal 8001\n}", "at Caddyfile:4|dynamic upstreams already specified"},
		{"dynamic unknown", "llm_proxy {\n\tdynamic nope\n}", "getting module named 'http.reverse_proxy.upstreams.nope'"},
		{"static and dynamic", "llm_proxy 127.0.0.1:9000 {\n\tdynamic a example.internal 8000\n}", "at Caddyfile:4|upstreams and dynamic upstreams cannot be used together"},
		{"lb_policy without name", "llm_proxy 127.0.0.1:9000 {\n\tlb_policy\n}", "at Caddyfile:3|wrong argument count"},
		{"lb_policy twice", "llm_proxy 127.0.0.1:9000 {\n\tlb_policy first\n\tlb_policy random\n}", "at Caddyfile:4|load balancing selection policy already specified"},
		{"lb_policy unknown", "llm_proxy 127.0.0.1:9000 {\n\tlb_policy fastest\n}", "getting module named 'http.reverse_proxy.selection_policies.fastest'"},
		{"transport without name", "llm_proxy 127.0.0.1:9000 {\n\ttransport\n}", "at Caddyfile:3|wrong argument count"},
		{"transport fastcgi", "llm_proxy 127.0.0.1:9000 {\n\ttransport fastcgi\n}", `at Caddyfile:3|unsupported transport "fastcgi"`},
		{"transport twice", "llm_proxy 127.0.0.1:9000 {\n\ttransport http\n\ttransport http\n}", "at Caddyfile:4|transport already specified"},
		{"transport bad option", "llm_proxy 127.0.0.1:9000 {\n\ttransport http {\n\t\tdial_timeout soon\n\t}\n}", "at Caddyfile:4|bad timeout value"},
		{"body size junk", "llm_proxy 127.0.0.1:9000 {\n\tmax_request_body lots\n}", `at Caddyfile:3|bad max_request_body "lots"`},
		{"body size zero", "llm_proxy 127.0.0.1:9000 {\n\tmax_request_body 0\n}", `at Caddyfile:3|bad max_request_body "0"`},
		{"body size missing", "llm_proxy 127.0.0.1:9000 {\n\tmax_request_body\n}", "at Caddyfile:3|wrong argument count"},
		{"body size extra arg", "llm_proxy 127.0.0.1:9000 {\n\tmax_request_body 1MiB 2MiB\n}", "at Caddyfile:3|wrong argument count"},
		{"first_byte_timeout junk", "llm_proxy 127.0.0.1:9000 {\n\tfirst_byte_timeout fast\n}", `at Caddyfile:3|bad first_byte_timeout "fast"`},
		{"first_byte_timeout zero", "llm_proxy 127.0.0.1:9000 {\n\tfirst_byte_timeout 0\n}", `at Caddyfile:3|bad first_byte_timeout "0"`},
		{"stream_idle_timeout negative", "llm_proxy 127.0.0.1:9000 {\n\tstream_idle_timeout -1s\n}", `at Caddyfile:3|bad stream_idle_timeout "-1s"`},
		{"stream_timeout missing", "llm_proxy 127.0.0.1:9000 {\n\tstream_timeout\n}", "at Caddyfile:3|wrong argument count"},
		{"stream_timeout extra", "llm_proxy 127.0.0.1:9000 {\n\tstream_timeout 1m 2m\n}", "at Caddyfile:3|wrong argument count"},
		{"api unknown", "llm_proxy 127.0.0.1:9000 {\n\tapi grpc\n}", `at Caddyfile:3|bad api "grpc"`},
		{"api missing", "llm_proxy 127.0.0.1:9000 {\n\tapi\n}", "at Caddyfile:3|wrong argument count"},
		{"api twice", "llm_proxy 127.0.0.1:9000 {\n\tapi chat\n\tapi messages\n}", "api already specified"},
		{"name twice", "llm_proxy 127.0.0.1:9000 {\n\tname a\n\tname b\n}", "at Caddyfile:4|name already specified"},
		{"name without label", "llm_proxy 127.0.0.1:9000 {\n\tname\n}", "at Caddyfile:3|wrong argument count"},
		{"name of two words", "llm_proxy 127.0.0.1:9000 {\n\tname a b\n}", "name: want one non-empty label"},
		{"max_attempts zero", "llm_proxy 127.0.0.1:9000 {\n\tmax_attempts 0\n}", `at Caddyfile:3|bad max_attempts "0"`},
		{"max_attempts junk", "llm_proxy 127.0.0.1:9000 {\n\tmax_attempts two\n}", `at Caddyfile:3|bad max_attempts "two"`},
		{"max_attempts missing", "llm_proxy 127.0.0.1:9000 {\n\tmax_attempts\n}", "at Caddyfile:3|wrong argument count"},
		{"max_attempts extra", "llm_proxy 127.0.0.1:9000 {\n\tmax_attempts 2 3\n}", "at Caddyfile:3|wrong argument count"},
		{"retries twice", "llm_proxy 127.0.0.1:9000 {\n\tretries\n\tretries\n}", "at Caddyfile:4|retries already specified"},
		{"retries arg", "llm_proxy 127.0.0.1:9000 {\n\tretries 3\n}", "at Caddyfile:3|wrong argument count"},
		{"retries unknown", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tcount 3\n\t}\n}", `at Caddyfile:4|unrecognized retries option "count"`},
		{"retries ratio", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tratio 2\n\t}\n}", `at Caddyfile:4|bad ratio "2"`},
		{"retries ratio args", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tratio\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"retries window", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\twindow 0s\n\t}\n}", `at Caddyfile:4|bad retries window "0s"`},
		{"retries window args", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\twindow\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"retries min_per_sec", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tmin_per_sec -1\n\t}\n}", `at Caddyfile:4|bad min_per_sec "-1"`},
		{"retries min_per_sec args", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tmin_per_sec\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"retries bucket form", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbucket 10\n\t}\n}", "at Caddyfile:4|want: bucket <max_tokens> <refill_per_sec>"},
		{"retries bucket max", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbucket 0.5 1\n\t}\n}", `at Caddyfile:4|bad bucket max_tokens "0.5"`},
		{"retries bucket refill", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbucket 10 0\n\t}\n}", `at Caddyfile:4|bad bucket refill_per_sec "0"`},
		{"retries both forms", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tratio 0.2\n\t\tbucket 10 1\n\t}\n}", "at Caddyfile:6|bucket replaces ratio"},
		{"retries backoff form", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbackoff 100ms\n\t}\n}", "at Caddyfile:4|want: backoff <base> <cap>"},
		{"retries backoff base", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbackoff soon 2s\n\t}\n}", `at Caddyfile:4|bad backoff base "soon"`},
		{"retries backoff cap", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbackoff 100ms later\n\t}\n}", `at Caddyfile:4|bad backoff cap "later"`},
		{"retries backoff order", "llm_proxy 127.0.0.1:9000 {\n\tretries {\n\t\tbackoff 2s 100ms\n\t}\n}", "at Caddyfile:4|backoff cap 100ms is below its base 2s"},
		{"hedge twice", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t}\n\thedge {\n\t\tafter 1s\n\t}\n}", "at Caddyfile:6|hedge already specified"},
		{"hedge arg", "llm_proxy 127.0.0.1:9000 {\n\thedge 1s\n}", "at Caddyfile:3|wrong argument count"},
		{"hedge without after", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tmax_ratio 0.1\n\t}\n}", "at Caddyfile:5|hedge: after is required"},
		{"hedge after junk", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter soon\n\t}\n}", "at Caddyfile:4|invalid hedge delay"},
		{"hedge after low percentile", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter p10\n\t}\n}", "at Caddyfile:4|invalid hedge delay"},
		{"hedge min over max", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter p95 min 3s max 2s\n\t}\n}", "at Caddyfile:4|min 3s is above max 2s"},
		{"hedge max_ratio", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t\tmax_ratio 0\n\t}\n}", `at Caddyfile:5|bad max_ratio "0"`},
		{"hedge max_ratio args", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t\tmax_ratio\n\t}\n}", "at Caddyfile:5|wrong argument count"},
		{"hedge max_hedges", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t\tmax_hedges 0\n\t}\n}", `at Caddyfile:5|bad max_hedges "0"`},
		{"hedge max_hedges args", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t\tmax_hedges\n\t}\n}", "at Caddyfile:5|wrong argument count"},
		{"hedge unknown", "llm_proxy 127.0.0.1:9000 {\n\thedge {\n\t\tafter 1s\n\t\tdelay 1s\n\t}\n}", `at Caddyfile:5|unrecognized hedge option "delay"`},
		{"no upstreams", "llm_proxy {\n\tfirst_byte_timeout 1s\n}", "at Caddyfile:4|llm_proxy needs upstreams"},
		{"upstream path without scheme", "llm_proxy 127.0.0.1:9000/v1", `at Caddyfile:2|upstream "127.0.0.1:9000/v1": an upstream address has no path`},
		{"upstream twice", "llm_proxy 127.0.0.1:9000 {\n\tto 127.0.0.1:9000\n}", "at Caddyfile:3|upstream 127.0.0.1:9000 is listed twice"},
		{"scalar twice", "llm_proxy 127.0.0.1:9000 {\n\tfirst_byte_timeout 1s\n\tfirst_byte_timeout 2s\n}", "at Caddyfile:4|first_byte_timeout already specified"},
		{"hedges over attempts", "llm_proxy 127.0.0.1:9000 127.0.0.1:9001 {\n\thedge {\n\t\tafter 1s\n\t\tmax_hedges 2\n\t}\n}", "max_attempts of at least 3 (it is 2)"},
		{"breaker twice", "llm_proxy 127.0.0.1:9000 {\n\tbreaker off\n\tbreaker off\n}", "at Caddyfile:4|breaker already specified"},
		{"breaker junk arg", "llm_proxy 127.0.0.1:9000 {\n\tbreaker on\n}", `at Caddyfile:3|unexpected breaker argument "on"`},
		{"breaker off extra", "llm_proxy 127.0.0.1:9000 {\n\tbreaker off now\n}", "at Caddyfile:3|wrong argument count"},
		{"breaker max_ejection range", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tmax_ejection 30\n\t}\n}", `at Caddyfile:4|bad max_ejection "30"`},
		{"breaker panic_threshold junk", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tpanic_threshold never\n\t}\n}", `at Caddyfile:4|bad panic_threshold "never"`},
		{"breaker panic_threshold missing", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tpanic_threshold\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"breaker unknown option", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\ttrip_fast 1\n\t}\n}", `at Caddyfile:4|unrecognized breaker option "trip_fast"`},
		{"breaker consecutive junk", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tconsecutive_failures many\n\t}\n}", `at Caddyfile:4|bad consecutive_failures "many"`},
		{"breaker consecutive missing", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tconsecutive_failures\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"breaker failures form", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tfailures 10 in 30s\n\t}\n}", "at Caddyfile:4|want: failures <n> within <duration>"},
		{"breaker failures window", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tfailures 10 within never\n\t}\n}", `at Caddyfile:4|bad failures window "never"`},
		{"breaker ratio range", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tfailure_ratio 1.5\n\t}\n}", `at Caddyfile:4|bad failure_ratio "1.5"`},
		{"breaker ratio form", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tfailure_ratio 0.5 min_requests\n\t}\n}", "at Caddyfile:4|want: failure_ratio <ratio>"},
		{"breaker ratio option", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tfailure_ratio 0.5 over 30s\n\t}\n}", `at Caddyfile:4|unexpected failure_ratio option "over"`},
		{"breaker slow_ttft junk", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tslow_ttft slow\n\t}\n}", `at Caddyfile:4|bad slow_ttft "slow"`},
		{"breaker slow_ratio without slow_ttft", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tslow_ratio 0.5\n\t}\n}", "at Caddyfile:5|breaker:"},
		{"breaker min_open extra", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tmin_open 1s 2s\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"breaker probes zero", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\thalf_open_probes 0\n\t}\n}", `at Caddyfile:4|bad half_open_probes "0"`},
		{"breaker scope", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tscope tenant\n\t}\n}", "at Caddyfile:4|want: scope upstream|model"},
		{"breaker probe args", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe /health\n\t}\n}", "at Caddyfile:4|wrong argument count"},
		{"probe uri", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe {\n\t\t\turi health\n\t\t}\n\t}\n}", `at Caddyfile:5|probe uri "health" must start with /`},
		{"probe chat json", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe {\n\t\t\tchat {nope\n\t\t}\n\t}\n}", "probe chat body is not valid JSON"},
		{"probe both", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe {\n\t\t\turi /health\n\t\t\tchat `{}`\n\t\t}\n\t}\n}", "probe: use uri or chat, not both"},
		{"probe unknown", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe {\n\t\t\tevery 5s\n\t\t}\n\t}\n}", `at Caddyfile:5|unrecognized probe option "every"`},
		{"probe interval", "llm_proxy 127.0.0.1:9000 {\n\tbreaker {\n\t\tprobe {\n\t\t\tinterval 0s\n\t\t}\n\t}\n}", `at Caddyfile:5|bad probe interval "0s"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := adapt(t, ":8080 {\n"+tc.body+"\n}\n")
			if err == nil {
				t.Fatalf("adapt succeeded; want error containing %q", tc.want)
			}
			// want is "at Caddyfile:N|message": the location and the message.
			for _, part := range strings.Split(tc.want, "|") {
				if !strings.Contains(err.Error(), part) {
					t.Fatalf("error %q\ndoes not contain %q", err, part)
				}
			}
		})
	}
}

// TestDirectiveOrderedBeforeReverseProxy: in a site with both, llm_proxy
// handles the request first.
func TestDirectiveOrderedBeforeReverseProxy(t *testing.T) {
	out, err := adapt(t, ":8080 {\n\treverse_proxy 127.0.0.1:9001\n\tllm_proxy 127.0.0.1:9000\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	s := string(out)
	lp, rp := strings.Index(s, `"handler":"llm_proxy"`), strings.Index(s, `"handler":"reverse_proxy"`)
	if lp < 0 || rp < 0 || lp > rp {
		t.Fatalf("llm_proxy should come before reverse_proxy in %s", s)
	}
}

// TestUnmarshalDefaults: a bare directive yields empty fields, which
// Provision turns into the documented defaults.
func TestUnmarshalDefaults(t *testing.T) {
	var h Handler
	d := caddyfile.NewTestDispenser("llm_proxy 127.0.0.1:9000 https://10.0.0.2")
	if err := h.UnmarshalCaddyfile(d); err == nil {
		t.Fatal("mixed http and https upstreams should be refused")
	}
	h = Handler{}
	d = caddyfile.NewTestDispenser("llm_proxy https://10.0.0.2 https://10.0.0.3:8443")
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if len(h.Upstreams) != 2 || h.Upstreams[0].Dial != "10.0.0.2:443" || h.Upstreams[1].Dial != "10.0.0.3:8443" {
		t.Fatalf("upstreams = %v", h.Upstreams)
	}
	if !strings.Contains(string(h.TransportRaw), `"tls":{}`) {
		t.Fatalf("https upstreams should enable TLS on the transport: %s", h.TransportRaw)
	}
	if h.MaxAttempts != 0 || h.FirstByteTimeout != 0 || h.MaxRequestBody != 0 {
		t.Fatalf("unset fields should stay zero: %+v", h)
	}
}

// FuzzUnmarshalCaddyfile feeds arbitrary llm_proxy blocks to the parser:
// it must never panic, and whatever it accepts must marshal to JSON.
func FuzzUnmarshalCaddyfile(f *testing.F) {
	seeds := []string{
		"llm_proxy 127.0.0.1:9000",
		"llm_proxy {\n to 127.0.0.1:9000 127.0.0.1:9001\n lb_policy round_robin\n}",
		"llm_proxy 127.0.0.1:9000 {\n max_request_body 16MiB\n first_byte_timeout 30s\n stream_idle_timeout 1m\n stream_timeout 10m\n max_attempts 3\n}",
		"llm_proxy {\n dynamic a vllm.internal 8000\n}",
		"llm_proxy https://10.0.0.1 {\n transport http {\n  dial_timeout 2s\n  keepalive 30s\n }\n}",
		"llm_proxy h2c://127.0.0.1:9000",
		"llm_proxy unix//run/vllm.sock",
		"llm_proxy 127.0.0.1:9000 {\n lb_policy random_choose 2\n}",
		"llm_proxy {\n}",
		"llm_proxy 127.0.0.1:9000 { max_attempts 99999999999999999999 }",
		"llm_proxy 127.0.0.1:9000 {\n api messages\n}",
		"llm_proxy 127.0.0.1:9000 {\n lb_policy least_queue\n saturation {\n  interval 2s\n  preset tgi\n  metric kv_usage my:kv\n  trip queue_wait_p99 3s for 20s\n  trip kv_usage 0.95\n }\n}",
		"llm_proxy 127.0.0.1:9000 {\n saturation {\n  trip off\n }\n}",
		"llm_proxy 127.0.0.1:9000 127.0.0.1:9001 {\n lb_policy prefix_cache {\n  block_chars 128\n  max_blocks 1000\n  load_factor 1.5\n }\n}",
		"llm_proxy 127.0.0.1:9000 {\n fallback small {\n  to 127.0.0.1:9001\n  model llama-8b\n  context_window 8192\n  max_output_tokens 4096\n  when unavailable saturated\n  tiers free batch\n  capacity 4\n }\n}",
		"llm_proxy 127.0.0.1:9000 {\n fallback a {\n  dynamic a small.internal 8000\n }\n fallback b {\n  to 127.0.0.1:9002\n }\n}",
		"llm_proxy 127.0.0.1:9000 127.0.0.1:9001 {\n breaker {\n  max_ejection 0.5\n  panic_threshold off\n }\n}",
		"llm_proxy 127.0.0.1:9000 {\n breaker {\n  panic_threshold 0.25\n }\n}",
		"llm_proxy 127.0.0.1:9000 {\n header_up Authorization \"Bearer {env.K}\"\n header_up +X-A 1\n header_up -X-B\n header_up X-C ^a(.*)$ b$1\n header_down -Server\n forward_tenant_keys\n}",
		"llm_proxy 127.0.0.1:9000 {\n fallback h {\n  to 127.0.0.1:9001\n  header_up x-api-key {env.K}\n  header_up Host {upstream_hostport}\n  header_down ?X-D v\n  forward_tenant_keys\n }\n}",
	}
	for _, s := range seeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, src string) {
		var h Handler
		d := caddyfile.NewTestDispenser(src)
		if err := h.UnmarshalCaddyfile(d); err != nil {
			return
		}
		if _, err := json.Marshal(&h); err != nil {
			t.Fatalf("accepted config does not marshal: %v", err)
		}
		if h.MaxAttempts < 0 || h.MaxRequestBody < 0 || h.FirstByteTimeout < 0 || h.StreamTimeout < 0 {
			t.Fatalf("accepted a negative setting: %+v", h)
		}
		for _, fc := range h.Fallbacks {
			if err := fc.check(); err != nil {
				t.Fatalf("accepted a fallback that Provision refuses: %v", err)
			}
		}
		if err := h.Breaker.validate(); err != nil {
			t.Fatalf("accepted a breaker block that Validate refuses: %v", err)
		}
	})
}

// The ejection cap and the panic rule parse into the breaker block, "off"
// as -1, and reach the pool's settings with their defaults otherwise.
func TestBreakerEjectionOptions(t *testing.T) {
	for _, tc := range []struct {
		in       string
		max, thr float64
	}{
		{"breaker {\n\tmax_ejection 0.5\n\tpanic_threshold off\n}", 0.5, -1},
		{"breaker {\n\tpanic_threshold 0.25\n}", 0, 0.25},
	} {
		d := caddyfile.NewTestDispenser(tc.in)
		d.Next()
		bc, err := parseBreaker(d)
		if err != nil {
			t.Fatalf("%q: %v", tc.in, err)
		}
		if bc.MaxEjection != tc.max || bc.PanicThreshold != tc.thr {
			t.Fatalf("%q: max_ejection %v, panic_threshold %v; want %v, %v", tc.in, bc.MaxEjection, bc.PanicThreshold, tc.max, tc.thr)
		}
		e := bc.ejection().WithDefaults()
		if want := max(tc.max, upstream.DefaultMaxEjection); tc.max == 0 && e.MaxEjection != want {
			t.Fatalf("%q: effective max_ejection %v, want the default %v", tc.in, e.MaxEjection, want)
		}
	}
	if err := (&BreakerConfig{PanicThreshold: -0.5}).validate(); err == nil {
		t.Fatal("panic_threshold -0.5 in JSON: no error")
	}
}
