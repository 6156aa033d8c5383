package redistest

import (
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestServerAnswersAndRestartsEmptyOnTheSamePort(t *testing.T) {
	s := Start(t, Options{})
	if _, err := s.Do("SET", "k", "v"); err != nil {
		t.Fatal(err)
	}
	if v, err := s.Do("GET", "k"); err != nil || v != "v" {
		t.Fatalf("GET = %q, %v", v, err)
	}
	if _, err := s.Do("SCRIPT", "LOAD", "return 1"); err != nil {
		t.Fatal(err)
	}
	addr := s.Addr()
	s.Restart()
	if s.Addr() != addr {
		t.Fatalf("address changed across Restart: %s → %s", addr, s.Addr())
	}
	if v, err := s.Do("GET", "k"); err != nil || v != "" {
		t.Fatalf("GET after Restart = %q, %v; want empty (no persistence)", v, err)
	}
	if v, err := s.Do("SCRIPT", "EXISTS", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db"); err != nil || v != "0" {
		t.Fatalf("script cache after Restart: %q, %v; want empty", v, err)
	}
	s.Stop()
	if _, err := s.Do("PING"); err == nil {
		t.Fatal("PING answered after Stop")
	}
	s.Stop() // twice is fine
}

func TestServerWithPasswordRefusesUnauthenticatedClients(t *testing.T) {
	s := Start(t, Options{Password: "s3cret"})
	if v, err := s.Do("PING"); err != nil || v != "PONG" {
		t.Fatalf("PING with password = %q, %v", v, err)
	}
	if _, err := command(s.Addr(), "", time.Second, "PING"); err == nil || !strings.HasPrefix(err.Error(), "NOAUTH") {
		t.Fatalf("PING without password: %v, want NOAUTH", err)
	}
	if want := "redis://:s3cret@" + s.Addr(); s.URL() != want {
		t.Fatalf("URL = %q, want %q", s.URL(), want)
	}
}

func TestSentinelKnowsItsMaster(t *testing.T) {
	m := Start(t, Options{Password: "pw"})
	sen := StartSentinel(t, m, "mymaster")
	v, err := sen.Do("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster")
	if err != nil || v != strings.Replace(m.Addr(), ":", "\n", 1) {
		t.Fatalf("get-master-addr-by-name = %q, %v; want %s", v, err, m.Addr())
	}
}

func TestProxyModes(t *testing.T) {
	s := Start(t, Options{})
	p := NewProxy(t, s.Addr())
	do := func(timeout time.Duration, args ...string) (string, time.Duration, error) {
		start := time.Now()
		v, err := command(p.Addr(), "", timeout, args...)
		return v, time.Since(start), err
	}

	if v, _, err := do(time.Second, "PING"); err != nil || v != "PONG" {
		t.Fatalf("pass: %q, %v", v, err)
	}

	p.Latency(80 * time.Millisecond)
	if v, took, err := do(time.Second, "PING"); err != nil || v != "PONG" || took < 80*time.Millisecond {
		t.Fatalf("slow: %q after %v, %v; want PONG after ≥ 80ms", v, took, err)
	}

	p.Blackhole()
	if _, took, err := do(150*time.Millisecond, "PING"); !isTimeout(err) || took < 150*time.Millisecond {
		t.Fatalf("blackhole: %v after %v, want a timeout", err, took)
	}

	p.Mute()
	if _, _, err := do(150*time.Millisecond, "SET", "muted", "1"); !isTimeout(err) {
		t.Fatalf("mute: %v, want a timeout", err)
	}
	if v, err := s.Do("GET", "muted"); err != nil || v != "1" {
		t.Fatalf("mute: the server has %q, %v; want the command applied", v, err)
	}

	// A connection open before the reset is reset, and so are new ones.
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	p.Pass()
	waitLinks(t, p, 1)
	p.Reset()
	_ = c.SetReadDeadline(time.Now().Add(time.Second))
	if _, err := c.Read(make([]byte, 1)); !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("existing connection after Reset: %v, want ECONNRESET", err)
	}
	if _, _, err := do(time.Second, "PING"); err == nil {
		t.Fatal("reset: a new connection got an answer")
	}

	p.Pass()
	if v, _, err := do(time.Second, "PING"); err != nil || v != "PONG" {
		t.Fatalf("pass again: %q, %v", v, err)
	}
	if p.Accepted() < 6 {
		t.Fatalf("Accepted = %d, want ≥ 6", p.Accepted())
	}
}

func TestProxySetTargetMovesNewConnections(t *testing.T) {
	a, b := Start(t, Options{}), Start(t, Options{})
	if _, err := b.Do("SET", "who", "b"); err != nil {
		t.Fatal(err)
	}
	p := NewProxy(t, a.Addr())
	p.SetTarget(b.Addr())
	if v, err := command(p.Addr(), "", time.Second, "GET", "who"); err != nil || v != "b" {
		t.Fatalf("GET through the moved proxy = %q, %v", v, err)
	}
}

func waitLinks(t *testing.T, p *Proxy, n int) {
	t.Helper()
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		p.mu.Lock()
		got := len(p.links)
		p.mu.Unlock()
		if got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d links, want %d", got, n)
		}
	}
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}
