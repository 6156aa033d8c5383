package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"
)

func TestMeasureLevelReportsAddedLatencyAgainstDirect(t *testing.T) {
	stream := func(ttft time.Duration) string {
		return fakeSSE(t, 200, step{ttft, chunk("a")}, step{time.Millisecond, chunk("b")}, step{0, "data: [DONE]\n\n"}).URL
	}
	urls := map[string]string{
		PathDirect:       stream(0),
		PathLLMProxy:     stream(300 * time.Millisecond),
		PathReverseProxy: stream(100 * time.Millisecond),
	}
	order := []string{PathDirect, PathLLMProxy, PathReverseProxy}
	reqs := map[string]*Requester{}
	for name, u := range urls {
		reqs[name] = &Requester{Client: newHTTPClient(2), URL: u, Body: []byte("{}")}
	}
	lr := measureLevel(context.Background(), reqs, order, 2, 6, 4)
	if len(lr.Paths) != 3 {
		t.Fatalf("paths %+v", lr.Paths)
	}
	for _, p := range lr.Paths {
		if p.Requests != 6 || p.Errors != 0 {
			t.Errorf("%s: %d requests, %d errors; want 6, 0", p.Path, p.Requests, p.Errors)
		}
	}
	l, r := lr.Paths[1], lr.Paths[2]
	// Wide margins: this must hold on a busy machine.
	if l.AddedTTFTP50 < 200 || r.AddedTTFTP50 < 50 || lr.Paths[0].AddedTTFTP50 != 0 {
		t.Fatalf("added ttft p50: llm_proxy %v, reverse_proxy %v", l.AddedTTFTP50, r.AddedTTFTP50)
	}
	if lr.RatioP50 <= 1 {
		t.Errorf("ratio %v, want > 1; paths %+v", lr.RatioP50, lr.Paths)
	}

	var out bytes.Buffer
	printOverhead(&out, &OverheadReport{Config: OverheadConfig{Paths: urls}, Levels: []LevelResult{lr}})
	for _, want := range []string{"| 2 | llm_proxy | 6 | 0 |", "llm_proxy / reverse_proxy", "×"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

func TestParseLevels(t *testing.T) {
	if got, err := parseLevels("1, 100,"); err != nil || len(got) != 2 || got[0] != 1 || got[1] != 100 {
		t.Fatalf("parseLevels = %v, %v", got, err)
	}
	for _, bad := range []string{"", "0", "x", "1,-2"} {
		if _, err := parseLevels(bad); err == nil {
			t.Errorf("parseLevels(%q) accepted", bad)
		}
	}
}
