package mockllm

import (
	"net/http"
	"reflect"
	"testing"
)

// The seed corpora live in testdata/fuzz/<FuzzName>/.

// FuzzParseBehavior checks that any accepted spec validates and survives a
// round trip through String.
func FuzzParseBehavior(f *testing.F) {
	f.Fuzz(func(t *testing.T, spec string) {
		b, err := ParseBehavior(spec)
		if err != nil {
			return
		}
		if err := b.Validate(); err != nil {
			t.Fatalf("ParseBehavior(%q) = %+v, which does not validate: %v", spec, b, err)
		}
		back, err := ParseBehavior(b.String())
		if err != nil || !reflect.DeepEqual(back, b) {
			t.Fatalf("ParseBehavior(%q) = %+v; String %q parses to %+v, %v", spec, b, b.String(), back, err)
		}
	})
}

// FuzzParseFault checks that any accepted fault spec validates and
// survives a round trip through String.
func FuzzParseFault(f *testing.F) {
	f.Fuzz(func(t *testing.T, spec string) {
		fl, err := ParseFault(spec)
		if err != nil {
			return
		}
		if err := fl.Validate(); err != nil {
			t.Fatalf("ParseFault(%q) = %+v, which does not validate: %v", spec, fl, err)
		}
		back, err := ParseFault(fl.String())
		if err != nil || back != fl {
			t.Fatalf("ParseFault(%q) = %+v; String %q parses to %+v, %v", spec, fl, fl.String(), back, err)
		}
	})
}

// FuzzBehaviorHeaders feeds arbitrary values to every X-Mock-* header and
// checks that what is accepted can be sent again with Headers.
func FuzzBehaviorHeaders(f *testing.F) {
	f.Fuzz(func(t *testing.T, ttft, straggler, tokens, interval, tps, tokenBytes, fault string) {
		h := http.Header{}
		for name, v := range map[string]string{
			HeaderTTFT: ttft, HeaderStraggler: straggler, HeaderTokens: tokens, HeaderTokenInterval: interval,
			HeaderTPS: tps, HeaderTokenBytes: tokenBytes, HeaderFault: fault,
		} {
			h.Set(name, v)
		}
		b, err := Behavior{}.WithHeaders(h)
		if err != nil {
			return
		}
		if err := b.Validate(); err != nil {
			t.Fatalf("headers %v give %+v, which does not validate: %v", h, b, err)
		}
		back, err := Behavior{}.WithHeaders(b.Headers())
		if err != nil || !reflect.DeepEqual(back, b) {
			t.Fatalf("headers %v give %+v; Headers() %v give %+v, %v", h, b, b.Headers(), back, err)
		}
	})
}

// FuzzParseMetricsMode checks that any accepted /metrics mode spec
// validates and survives a round trip through String.
func FuzzParseMetricsMode(f *testing.F) {
	f.Fuzz(func(t *testing.T, spec string) {
		m, err := ParseMetricsMode(spec)
		if err != nil {
			return
		}
		if err := m.Validate(); err != nil {
			t.Fatalf("ParseMetricsMode(%q) = %+v, which does not validate: %v", spec, m, err)
		}
		back, err := ParseMetricsMode(m.String())
		if err != nil || back != m {
			t.Fatalf("ParseMetricsMode(%q) = %+v; String %q parses to %+v, %v", spec, m, m.String(), back, err)
		}
	})
}
