package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmproxy/caddy-llm-proxy/admission"
	"github.com/llmproxy/caddy-llm-proxy/breaker"
	"github.com/llmproxy/caddy-llm-proxy/internal/redistest"
)

// onOtherNode returns the first name of the form prefix<i> whose key
// lands on a node other than not's (the index of a node), and its node.
func onOtherNode(t *testing.T, c *redistest.Cluster, prefix string, key func(string) string, not int) (string, int) {
	t.Helper()
	for i := range 200 {
		name := fmt.Sprintf("%s%d", prefix, i)
		if n := c.NodeOf(key(name)); n >= 0 && n != not {
			return name, n
		}
	}
	t.Fatalf("no %s<i> off node %d", prefix, not)
	return "", -1
}

// noBadReplies fails the test when an operation got an error reply such
// as CROSSSLOT (kind other) or a script error.
func noBadReplies(t *testing.T, gws ...*gateway) {
	t.Helper()
	for _, g := range gws {
		g.ops.mu.Lock()
		for _, o := range g.ops.ops {
			if strings.HasSuffix(o, " "+string(KindOther)) || strings.HasSuffix(o, " "+string(KindScript)) {
				t.Errorf("%s: operation %q", g.id, o)
			}
		}
		g.ops.mu.Unlock()
	}
}

// TestRedisCluster: two gateways on a 3-node Redis Cluster. A key tripped
// on one opens on the other; one of them wins the probe lease; the fleet
// limits of two tenants whose keys sit on different nodes hold across the
// gateways; Instances lists both; no operation gets CROSSSLOT.
func TestRedisCluster(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	if !strings.HasPrefix(c.URL(), "redis+cluster://") {
		t.Fatalf("URL %s", c.URL())
	}
	lc := &leaseCounts{n: make(map[string]int)}
	var gws []*gateway
	for i := range 2 {
		id := fmt.Sprintf("gw%d", i)
		g := startGateway(t, c.URL(), id, 1, BreakersOptions{LeaseTTL: testLease, OnLease: lc.hook(id)})
		g.s = leaseSettings
		gws = append(gws, g)
	}
	if _, ok := gws[0].c.rdb.Load().UniversalClient.(*redis.ClusterClient); !ok {
		t.Fatalf("a %T, want a cluster client", gws[0].c.rdb.Load().UniversalClient)
	}
	waitFor(t, "both gateways in fleet mode", 2*time.Second, func() bool {
		return !gws[0].c.Degraded() && !gws[1].c.Degraded()
	})

	// Breakers: up1 and another key on another node (the bulk refresh
	// reads both in one pipeline, split by node).
	bkey := func(k string) string { return redisKey(k, "open") }
	n1 := c.NodeOf(bkey("up1"))
	other, _ := onOtherNode(t, c, "up", bkey, n1)
	for _, g := range gws {
		g.b("up1")
		g.b(other)
	}
	gws[1].fail(other, 3)
	gws[0].fail("up1", 3)
	waitState(t, "both gateways' up1", breaker.Open, gws[0].b("up1"), gws[1].b("up1"))
	waitState(t, "both gateways' "+other, breaker.Open, gws[0].b(other), gws[1].b(other))
	var until time.Time
	waitFor(t, "the fleet's open record of up1 on both", 2*time.Second, func() bool {
		for _, g := range gws {
			st, ok := g.bs.Opened("up1")
			if !ok || st.By != "gw0" {
				return false
			}
			until = st.Until
		}
		return true
	})
	if st, ok := gws[0].bs.Opened(other); !ok || st.By != "gw1" {
		t.Fatalf("gw0 adopted %s: %+v %v, want opened by gw1", other, st, ok)
	}

	// Instances, from either gateway.
	for _, g := range gws {
		ins, err := g.c.Instances(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if ids := []string{ins[0].ID, ins[1].ID}; len(ins) != 2 || !(ids[0] == "gw0" && ids[1] == "gw1" || ids[0] == "gw1" && ids[1] == "gw0") {
			t.Fatalf("%s: instances %+v, want gw0 and gw1", g.id, ins)
		}
	}

	// Fleet limits: two tenants on different nodes, concurrency 1 each.
	tkey := func(tn string) string { return buildKey(DefaultKeyPrefix, "tenant:"+tn, "win") }
	ta := "acme"
	tb, _ := onOtherNode(t, c, "beta", tkey, c.NodeOf(tkey(ta)))
	var ls []*Limits
	for _, g := range gws {
		l, err := NewLimits(g.c, LimitsConfig{LeaseTTL: testLeaseTTL, RenewEvery: testRenew})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(l.Close)
		ls = append(ls, l)
	}
	quota := func(tn string) admission.Quota {
		return admission.Quota{Tenant: tn, MaxConcurrent: 1, RPM: 100, TPM: 10000, Prompt: 100, Need: 300, Explicit: true}
	}
	holds := map[string]*admission.Hold{}
	for _, tn := range []string{ta, tb} {
		q, h := quota(tn), &admission.Hold{}
		if d := ls[0].Reserve(&q, h); d.Code != "" || d.Local || d.Reserved != 300 {
			t.Fatalf("%s on gw0: %+v", tn, d)
		}
		holds[tn] = h
	}
	time.Sleep(3 * testRenew) // the leases are renewed in one pipeline over two nodes
	for _, tn := range []string{ta, tb} {
		q, h := quota(tn), &admission.Hold{}
		if d := ls[1].Reserve(&q, h); d.Code != admission.CodeTenantConcurrency || d.Local {
			t.Fatalf("%s on gw1 while gw0 holds its one lease: %+v, want %s", tn, d, admission.CodeTenantConcurrency)
		}
	}
	ls[0].Settle(holds[ta], 120)
	ls[0].Settle(holds[tb], 50)
	rc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(strings.TrimPrefix(c.URL(), "redis+cluster://"), ",")})
	t.Cleanup(func() { _ = rc.Close() })
	for tn, want := range map[string]string{ta: "120", tb: "50"} {
		v, err := rc.HGet(context.Background(), tkey(tn), "T").Result()
		if err != nil || v != want {
			t.Fatalf("%s's window tokens %q %v, want %s", tn, v, err, want)
		}
	}
	for _, tn := range []string{ta, tb} {
		q, h := quota(tn), &admission.Hold{}
		if d := ls[1].Reserve(&q, h); d.Code != "" || d.Local || d.Requests != 2 {
			t.Fatalf("%s on gw1 after gw0 settled: %+v", tn, d)
		}
		ls[1].Settle(h, 10)
	}
	if ls[0].Pending()+ls[1].Pending() != 0 {
		t.Fatal("settlements pending")
	}

	// The probe lease: one of the two probes up1 after the open time (give
	// or take the 100ms leaseFleet allows: gw0's breaker opened here before
	// its first script on the cluster, which loads the slot map and the
	// script, wrote the fleet's record).
	winner, p := probeOnce(t, gws, until.Add(-100*time.Millisecond), time.Until(until)+time.Second, testLease*8/10)
	// Both keys' leases are contested at about the same time: one winner
	// and one loser each.
	waitFor(t, "each key's lease won once and lost once", time.Second, func() bool {
		return lc.total(LeaseWon) == 2 && lc.total(LeaseLost) == 2 && lc.of(winner.id, LeaseWon) >= 1
	})
	p.Done(breaker.Success, 0, "")
	waitState(t, "both gateways' up1", breaker.Closed, gws[0].b("up1"), gws[1].b("up1"))

	noBadReplies(t, gws...)
}

func TestClusterURL(t *testing.T) {
	for _, tc := range []struct {
		name, url, password, wantPass string
		addrs                         []string
	}{
		{name: "nodes", url: "redis+cluster://10.0.0.1:7000,10.0.0.2:7001", addrs: []string{"10.0.0.1:7000", "10.0.0.2:7001"}},
		{name: "password in the URL", url: "redis+cluster://:pw@10.0.0.1:7000", addrs: []string{"10.0.0.1:7000"}, wantPass: "pw"},
		{name: "password as a setting", url: "redis+cluster://10.0.0.1:7000/", password: "pw", addrs: []string{"10.0.0.1:7000"}, wantPass: "pw"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o, err := Config{URL: tc.url, Password: tc.password}.Defaults().redisOptions()
			if err != nil {
				t.Fatal(err)
			}
			if !o.IsClusterMode || o.MasterName != "" || strings.Join(o.Addrs, ",") != strings.Join(tc.addrs, ",") || o.Password != tc.wantPass {
				t.Fatalf("options: cluster %v addrs %v password %q", o.IsClusterMode, o.Addrs, o.Password)
			}
			co := o.Cluster()
			if co.MaxRetries != -1 || co.MaxRedirects != 3 || !co.ContextTimeoutEnabled || co.ReadTimeout != DefaultOpTimeout || co.PoolTimeout != DefaultOpTimeout {
				t.Errorf("not bounded by op_timeout: retries %d, redirects %d, context timeouts %v, read %v, pool %v",
					co.MaxRetries, co.MaxRedirects, co.ContextTimeoutEnabled, co.ReadTimeout, co.PoolTimeout)
			}
		})
	}
	for _, tc := range []struct{ name, url, want string }{
		{name: "db path", url: "redis+cluster://:hunter2@10.0.0.1:7000/3", want: "only db 0"},
		{name: "no port", url: "redis+cluster://:hunter2@10.0.0.1,10.0.0.2:7000", want: `node "10.0.0.1": want host:port`},
		{name: "two passwords", url: "redis+cluster://:hunter2@10.0.0.1:7000", want: "two different passwords"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := Config{URL: tc.url, Password: "other"}.Defaults().Validate()
			if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "hunter2") {
				t.Fatalf("Validate = %v, want an error containing %q, without the password", err, tc.want)
			}
		})
	}
	if err := (Config{URL: "redis+cluster://10.0.0.1:7000", DB: 2}).Defaults().Validate(); err == nil || !strings.Contains(err.Error(), "only db 0") {
		t.Fatalf("db 2 on a cluster: %v", err)
	}
}

// TestNoReplayHidesLostConnectionsFromRetries: a node's failure after
// sending reaches go-redis's retry logic as a sentError, and run sees the
// original; refused dials and error replies pass as they are.
func TestNoReplayHidesLostConnectionsFromRetries(t *testing.T) {
	dial := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("refused")}
	for _, tc := range []struct {
		err    error
		hidden bool
	}{
		{io.EOF, true},
		{&net.OpError{Op: "read", Net: "tcp", Err: errors.New("reset")}, true},
		{context.DeadlineExceeded, true},
		{dial, false},
		{redis.ErrPoolTimeout, false},
		{redis.ErrClosed, false},
		{redis.Nil, false},
		{nil, false},
	} {
		cmd := redis.NewCmd(context.Background(), "incr", "k")
		got := noReplay{}.ProcessHook(func(ctx context.Context, cmd redis.Cmder) error {
			cmd.SetErr(tc.err)
			return tc.err
		})(context.Background(), cmd)
		var se *sentError
		if hidden := errors.As(got, &se); hidden != tc.hidden {
			t.Fatalf("%v: returned %v, hidden %v, want %v", tc.err, got, hidden, tc.hidden)
		}
		if tc.hidden && (!errors.As(cmd.Err(), &se) || errors.Is(got, io.EOF) || unwrapSent(cmd.Err()) != tc.err) {
			t.Fatalf("%v: the command's error %v", tc.err, cmd.Err())
		}
		if !tc.hidden && got != tc.err {
			t.Fatalf("%v: changed to %v", tc.err, got)
		}
	}
}

// TestRedisClusterRatioAndInFlight: on a 3-node Redis Cluster, the ratio
// script (one hash tag per breaker key) opens a key on two gateways' sums,
// and InFlight reads the leases of two tenants on different nodes in one
// pipeline; no operation gets CROSSSLOT or a script error.
func TestRedisClusterRatioAndInFlight(t *testing.T) {
	c := redistest.StartCluster(t, 3)
	var gws []*gateway
	for i := range 2 {
		g := startGateway(t, c.URL(), fmt.Sprintf("gw%d", i), 1, BreakersOptions{})
		g.s = ratioSettings
		gws = append(gws, g)
	}
	waitFor(t, "both gateways in fleet mode", 2*time.Second, func() bool {
		return !gws[0].c.Degraded() && !gws[1].c.Degraded()
	})
	for _, g := range gws {
		for range 6 {
			g.call("up1", breaker.Success)
			g.call("up1", breaker.Failure)
		}
	}
	waitState(t, "both gateways' up1", breaker.Open, gws[0].b("up1"), gws[1].b("up1"))
	if st, _ := gws[0].bs.Opened("up1"); !strings.HasPrefix(st.Reason, "fleet: failure ratio 12/24") {
		t.Fatalf("reason %q", st.Reason)
	}

	tkey := func(tn string) string { return buildKey(DefaultKeyPrefix, "tenant:"+tn, "leases") }
	tb, _ := onOtherNode(t, c, "beta", tkey, c.NodeOf(tkey("acme")))
	l, err := NewLimits(gws[0].c, LimitsConfig{LeaseTTL: testLeaseTTL, RenewEvery: testRenew})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(l.Close)
	for _, tn := range []string{"acme", tb, tb} {
		q, h := admission.Quota{Tenant: tn, MaxConcurrent: 5, Prompt: 1, Need: 1}, &admission.Hold{}
		if d := l.Reserve(&q, h); d.Code != "" || d.Local {
			t.Fatalf("%s: %+v", tn, d)
		}
	}
	n, err := l.InFlight(context.Background(), []string{"acme", tb})
	if err != nil || n["acme"] != 1 || n[tb] != 2 {
		t.Fatalf("InFlight = %v, %v; want acme 1, %s 2", n, err, tb)
	}
	noBadReplies(t, gws...)
}
