package main

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"
)

func TestRunRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{
		{"--ttft", "soon"},
		{"--fault", "status=200"},
		{"--replica-fault", "x=hang"},
		{"--replica-fault", "5=hang", "--replicas", "2", "--listen", "127.0.0.1:0"},
		{"--replica-ttft", "0=lognormal:1s"},
		{"--tps", "0"},
		{"--idle-race", "1s", "--listen", "127.0.0.1:0"},
		{"--kv-blocks", "0"},
		{"--kv-block-tokens", "-1"},
		{"--metrics", "slow=0"},
		{"--replica-metrics", "0=kv=gpu"},
		{"--replica-metrics", "3=hang", "--replicas", "2", "--listen", "127.0.0.1:0"},
		{"extra"},
	} {
		var out, errOut bytes.Buffer
		if err := run(args, &out, &errOut); err == nil {
			t.Errorf("run(%q) succeeded", args)
		}
	}
}

func TestUsageDocumentsEveryFlagAndHeader(t *testing.T) {
	var out, errOut bytes.Buffer
	if err := run([]string{"--help"}, &out, &errOut); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: %v", err)
	}
	for _, want := range []string{
		"--listen", "--replicas", "--model", "--ttft", "--straggler", "--tokens", "--token-interval", "--tps",
		"--token-bytes", "--capacity", "--fault", "--replica-fault", "--replica-ttft", "--health-status", "--seed",
		"--grace", "--idle-timeout", "--idle-race", "--kv-blocks", "--kv-block-tokens", "--metrics", "--replica-metrics",
		"frozen", "hang", "status=CODE", "slow=DUR", "kv=new|old|both|none", "/mock/metrics", "--verbose", "X-Mock-TTFT", "X-Mock-Straggler", "X-Mock-Tokens", "X-Mock-Token-Interval",
		"X-Mock-TPS", "X-Mock-Token-Bytes", "X-Mock-Fault", "X-Mock-Replica",
	} {
		if !strings.Contains(errOut.String(), want) {
			t.Errorf("usage lacks %s", want)
		}
	}
}
