package mockllm

import (
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"
)

// countingDialer counts the TCP connections a client opens.
type countingDialer struct {
	mu sync.Mutex
	n  int
}

func (d *countingDialer) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	d.mu.Lock()
	d.n++
	d.mu.Unlock()
	return (&net.Dialer{}).DialContext(ctx, network, addr)
}

func (d *countingDialer) count() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.n
}

func TestIdleTimeoutClosesKeepAliveConnections(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, IdleTimeout: 100 * time.Millisecond})
	r := f.Replica(0)
	d := &countingDialer{}
	tr := &http.Transport{DisableCompression: true, DialContext: d.dial}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	get := func() {
		t.Helper()
		resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	get()
	get() // at once: the same connection
	if n := d.count(); n != 1 {
		t.Fatalf("%d connections for two back-to-back requests, want 1", n)
	}
	time.Sleep(300 * time.Millisecond) // past the idle timeout: the server closed it
	get()
	if n := d.count(); n != 2 {
		t.Fatalf("%d connections after an idle gap over the timeout, want 2", n)
	}
	if st := r.Stats(); st.Requests != 3 || st.IdleDrops != 0 {
		t.Fatalf("requests %d, idle drops %d; want 3 and 0", st.Requests, st.IdleDrops)
	}
}

func TestIdleCloseRaceDropsRequestOnStaleConnection(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: fast, IdleTimeout: 400 * time.Millisecond, IdleCloseRace: 300 * time.Millisecond})
	r := f.Replica(0)
	c := client(t)
	send := func() error {
		resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	if err := send(); err != nil {
		t.Fatal(err)
	}
	if err := send(); err != nil { // within 100ms: reused and served
		t.Fatalf("a request on a connection idle for well under the race window: %v", err)
	}
	time.Sleep(200 * time.Millisecond) // idle 200ms: past 400ms-300ms, before the close
	if err := send(); err == nil {
		t.Fatal("a request on a connection idle inside the race window was answered, want it dropped")
	} else {
		t.Logf("dropped request: %v", err)
	}
	if err := send(); err != nil { // a fresh connection
		t.Fatalf("a request on a new connection: %v", err)
	}
	st := r.Stats()
	if st.IdleDrops != 1 || st.Requests != 3 || st.Completed != 3 {
		t.Fatalf("idle drops %d, requests %d, completed %d; want 1, 3, 3", st.IdleDrops, st.Requests, st.Completed)
	}
}

func TestMaxInFlightCountsConcurrentRequests(t *testing.T) {
	f := startFleet(t, FleetConfig{Behavior: Behavior{TTFT: Fixed(100 * time.Millisecond), Tokens: 1}})
	r := f.Replica(0)
	c := client(t)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			resp, err := post(t, c, context.Background(), r.URL()+"/v1/chat/completions", chatBody)
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
	}
	wg.Wait()
	if st := r.Stats(); st.MaxInFlight != 4 || st.InFlight != 0 {
		t.Fatalf("max in flight %d, in flight %d; want 4 and 0", st.MaxInFlight, st.InFlight)
	}
	r.ResetStats()
	if st := r.Stats(); st.MaxInFlight != 0 {
		t.Fatalf("max in flight %d after a reset with nothing in flight, want 0", st.MaxInFlight)
	}
}

func TestStartFleetRejectsBadIdleSettings(t *testing.T) {
	for _, cfg := range []FleetConfig{
		{IdleTimeout: -time.Second},
		{IdleCloseRace: time.Second},
		{IdleTimeout: time.Second, IdleCloseRace: 2 * time.Second},
	} {
		if f, err := StartFleet(cfg); err == nil {
			f.Close()
			t.Errorf("StartFleet(idle %v, race %v) succeeded, want an error", cfg.IdleTimeout, cfg.IdleCloseRace)
		}
	}
}
