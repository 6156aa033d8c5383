package redistest

import (
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Cluster is a running Redis Cluster of masters without replicas, each a
// Server with cluster mode on, the slots spread evenly over them. Stopped
// when the test ends.
type Cluster struct {
	Nodes []*Server
}

// StartCluster starts n redis-servers (at least 3, which redis-cli
// --cluster create requires) with --cluster-enabled yes, joins them with
// redis-cli --cluster create, and waits until every node reports
// cluster_state:ok. It skips the test when redis-server or redis-cli
// (Debian's redis-tools) is absent.
func StartCluster(t testing.TB, n int) *Cluster {
	t.Helper()
	if n < 3 {
		t.Fatalf("redistest: a cluster needs at least 3 masters, not %d", n)
	}
	binary(t)
	cli, err := exec.LookPath("redis-cli")
	if err != nil {
		t.Skip("redistest: redis-cli not found (Debian package redis-tools): cannot create a Redis Cluster")
	}
	c := &Cluster{}
	args := []string{"--cluster", "create"}
	for range n {
		s := Start(t, Options{Args: []string{
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", "5000",
		}})
		c.Nodes = append(c.Nodes, s)
		args = append(args, s.Addr())
	}
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	out, err := exec.Command(cli, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("redistest: redis-cli --cluster create: %v\n%s", err, lastLines(string(out), 10))
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, s := range c.Nodes {
		for {
			info, err := s.Do("CLUSTER", "INFO")
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("redistest: cluster node %s not ok after 10s: %q %v", s.Addr(), info, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	return c
}

// URL is redis+cluster://host:port,host:port,... naming every node.
func (c *Cluster) URL() string {
	addrs := make([]string, len(c.Nodes))
	for i, s := range c.Nodes {
		addrs[i] = s.Addr()
	}
	return "redis+cluster://" + strings.Join(addrs, ",")
}

// NodeOf returns the index in Nodes of the master that serves key's slot
// (CLUSTER KEYSLOT, then each node's CLUSTER NODES "myself" slot ranges),
// or -1.
func (c *Cluster) NodeOf(key string) int {
	slotStr, err := c.Nodes[0].Do("CLUSTER", "KEYSLOT", key)
	if err != nil {
		return -1
	}
	slot, err := strconv.Atoi(slotStr)
	if err != nil {
		return -1
	}
	for i, s := range c.Nodes {
		nodes, err := s.Do("CLUSTER", "NODES")
		if err != nil {
			continue
		}
		for _, line := range strings.Split(nodes, "\n") {
			f := strings.Fields(line)
			if len(f) < 9 || !strings.Contains(f[2], "myself") {
				continue
			}
			for _, r := range f[8:] {
				lo, hi, ok := strings.Cut(r, "-")
				if !ok {
					hi = lo
				}
				a, err1 := strconv.Atoi(lo)
				b, err2 := strconv.Atoi(hi)
				if err1 == nil && err2 == nil && slot >= a && slot <= b {
					return i
				}
			}
		}
	}
	return -1
}
