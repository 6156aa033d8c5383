package mockllm

import (
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseBehaviorSpecs(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want Behavior
	}{
		{"", Behavior{}},
		{"none", Behavior{}},
		{"ttft=200ms", Behavior{TTFT: Latency{Median: 200 * time.Millisecond}}},
		{"ttft=0", Behavior{TTFT: Latency{Median: NoDelay}}},
		{"ttft=lognormal:150ms:0.5", Behavior{TTFT: Latency{Median: 150 * time.Millisecond, Sigma: 0.5}}},
		{"straggler=0.05:2s-5s", Behavior{Straggler: Straggler{Fraction: 0.05, Min: 2 * time.Second, Max: 5 * time.Second}}},
		{"straggler=0.1:3s", Behavior{Straggler: Straggler{Fraction: 0.1, Min: 3 * time.Second, Max: 3 * time.Second}}},
		{"tokens=32; token_interval=5ms", Behavior{Tokens: 32, TokenInterval: 5 * time.Millisecond}},
		{"tokens=0; token-interval=0", Behavior{Tokens: NoTokens, TokenInterval: NoDelay}},
		{"tps=50", Behavior{TokenInterval: 20 * time.Millisecond}},
		{"X-Mock-Token-Bytes=1024", Behavior{TokenBytes: 1024}},
		{"model=llama-3; health_status=503", Behavior{Model: "llama-3", HealthStatus: 503}},
		{"fault=status=503,every=3,retry_after=2", Behavior{Fault: Fault{Kind: FaultStatus, Status: 503, Every: 3, RetryAfter: 2}}},
	} {
		got, err := ParseBehavior(tc.spec)
		if err != nil {
			t.Errorf("ParseBehavior(%q): %v", tc.spec, err)
			continue
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseBehavior(%q) = %+v, want %+v", tc.spec, got, tc.want)
		}
	}
}

func TestParseBehaviorRejects(t *testing.T) {
	for _, spec := range []string{
		"ttft", "ttft=-1s", "ttft=soon", "ttft=lognormal:1s", "ttft=lognormal:1s:-1", "ttft=lognormal:1s:NaN", "ttft=25h",
		"straggler=2:1s", "straggler=0.1", "straggler=0.1:5s-1s", "tokens=-1", "tokens=x", "tps=0", "tps=-3", "tps=Inf",
		"token_bytes=99999999", "health_status=42", "model=", "color=blue", "fault=explode",
	} {
		if b, err := ParseBehavior(spec); err == nil {
			t.Errorf("ParseBehavior(%q) = %+v, want an error", spec, b)
		}
	}
}

func TestParseFaultSpecs(t *testing.T) {
	for _, tc := range []struct {
		spec string
		want Fault
	}{
		{"none", Fault{}},
		{"status=503", Fault{Kind: FaultStatus, Status: 503}},
		{"status=503, fraction=0.3", Fault{Kind: FaultStatus, Status: 503, Fraction: 0.3}},
		{"hang", Fault{Kind: FaultHang}},
		{"hang-after-headers,comment_every=1s", Fault{Kind: FaultHangAfterHeaders, CommentInterval: time.Second}},
		{"reset,every=2", Fault{Kind: FaultReset, Every: 2}},
		{"cut=40", Fault{Kind: FaultCut, After: 40}},
		{"cut_rst=0", Fault{Kind: FaultCutRST}},
		{"error_event=3,error_code=400", Fault{Kind: FaultErrorEvent, After: 3, ErrorCode: 400}},
		{"fragment=1", Fault{Fragment: 1}},
		{"comment_every=5,fragment=3", Fault{CommentEvery: 5, Fragment: 3}},
	} {
		got, err := ParseFault(tc.spec)
		if err != nil {
			t.Errorf("ParseFault(%q): %v", tc.spec, err)
			continue
		}
		if got != tc.want {
			t.Errorf("ParseFault(%q) = %+v, want %+v", tc.spec, got, tc.want)
		}
	}
}

func TestParseFaultRejects(t *testing.T) {
	for _, spec := range []string{
		"status", "status=200", "status=600", "hang=1", "cut", "cut=-1", "hang,reset", "status=503,status=500",
		"every=3", "fraction=0.5", "status=503,fraction=0", "status=503,fraction=1.5", "status=503,every=2,fraction=0.5",
		"retry_after=2", "status=503,retry_after=0", "hang,retry_after=1", "error_code=400", "error_event=1,error_code=200",
		"fragment=0", "comment_every=0", "comment_every=-1s", "boom", "hang,",
	} {
		if f, err := ParseFault(spec); err == nil {
			t.Errorf("ParseFault(%q) = %+v, want an error", spec, f)
		}
	}
}

func TestBehaviorStringRoundTrips(t *testing.T) {
	b := Behavior{
		Model:         "m",
		TTFT:          LogNormal(150*time.Millisecond, 0.5),
		Straggler:     Straggler{Fraction: 0.05, Min: 2 * time.Second, Max: 5 * time.Second},
		Tokens:        NoTokens,
		TokenInterval: NoDelay,
		TokenBytes:    10,
		Fault:         Fault{Kind: FaultErrorEvent, After: 2, ErrorCode: 429, Fragment: 3, CommentInterval: time.Second},
		HealthStatus:  503,
	}
	want := "model=m; ttft=lognormal:150ms:0.5; straggler=0.05:2s-5s; tokens=0; token_interval=0s; token_bytes=10; " +
		"fault=error_event=2,error_code=429,fragment=3,comment_every=1s; health_status=503"
	if got := b.String(); got != want {
		t.Fatalf("String() = %q, want %q", got, want)
	}
	back, err := ParseBehavior(b.String())
	if err != nil || !reflect.DeepEqual(back, b) {
		t.Fatalf("ParseBehavior(String()) = %+v, %v; want %+v", back, err, b)
	}
	text, _ := b.MarshalText()
	var u Behavior
	if err := u.UnmarshalText(text); err != nil || !reflect.DeepEqual(u, b) {
		t.Fatalf("UnmarshalText = %+v, %v", u, err)
	}
}

func TestWithHeadersOverridesKnobs(t *testing.T) {
	base := Behavior{Tokens: 16, Fault: Fault{Kind: FaultHang}}
	h := http.Header{}
	h.Set(HeaderTTFT, "lognormal:100ms:0.2")
	h.Set(HeaderTokens, "4")
	h.Set(HeaderTokenInterval, "1s")
	h.Set(HeaderTPS, "100") // wins over the interval
	h.Set(HeaderFault, "none")
	got, err := base.WithHeaders(h)
	if err != nil {
		t.Fatal(err)
	}
	want := Behavior{TTFT: LogNormal(100*time.Millisecond, 0.2), Tokens: 4, TokenInterval: 10 * time.Millisecond}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("got %+v, want %+v", got, want)
	}
	h.Set(HeaderStraggler, "lots")
	if _, err := base.WithHeaders(h); err == nil || !strings.Contains(err.Error(), HeaderStraggler) {
		t.Errorf("bad header: %v", err)
	}
	// Headers() asks for the same knobs.
	back, err := Behavior{}.WithHeaders(want.Headers())
	if err != nil || !reflect.DeepEqual(back, want) {
		t.Errorf("WithHeaders(Headers()) = %+v, %v", back, err)
	}
}

func TestLatencySamples(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	if d := (Latency{}).sample(rng, DefaultTTFT); d != DefaultTTFT {
		t.Errorf("zero latency sampled %s", d)
	}
	if d := Fixed(0).sample(rng, DefaultTTFT); d != 0 {
		t.Errorf("no-delay latency sampled %s", d)
	}
	l := LogNormal(100*time.Millisecond, 0.5)
	below := 0
	for range 2000 {
		if l.sample(rng, 0) < 100*time.Millisecond {
			below++
		}
	}
	if below < 900 || below > 1100 {
		t.Errorf("%d of 2000 samples below the median", below)
	}
}

func TestTokenTextIsDeterministicUTF8(t *testing.T) {
	multi := 0
	for i := range 20 {
		a, b := tokenText(7, i, 0), tokenText(7, i, 0)
		if a != b || a == "" {
			t.Fatalf("token %d: %q vs %q", i, a, b)
		}
		if len([]rune(a)) != len(a) {
			multi++
		}
		if p := tokenText(7, i, 64); len(p) > 64 || len(p) < 61 || !strings.HasPrefix(p, a) {
			t.Errorf("padded token %d: %d bytes", i, len(p))
		}
	}
	if multi < 10 {
		t.Errorf("%d of 20 tokens have multi-byte characters", multi)
	}
}
