// Package fleet is the gateways' shared state in Redis (DESIGN §9): the
// connection, its health, the instance list, and the key layout; the
// stores that breaker/ and admission/ define build on it.
//
// # Fail-open
//
// Redis is never on a request's critical path for longer than one
// Config.OpTimeout: every operation goes through Client.Do, bounded by it.
// After FailuresToDegrade failures in a row (timeouts, broken connections,
// read-only replicas) the client is in local mode: Do returns ErrDegraded
// at once, the caller uses its local state, one warn line is logged. Every
// Config.Refresh the heartbeat (a write: a replica answers PING, not
// writes) checks whether Redis is back; when it is, one info line is
// logged and the OnModeChange hooks reconcile. A Redis that is
// down when the client opens gives a client in local mode, not an error.
//
// # Ambiguous failures
//
// go-redis never retries here (MaxRetries -1). An operation that timed out
// or lost its connection after sending may have been applied (Ambiguous):
// callers must not replay it blindly — a replayed increment opens a breaker
// early, a replayed reservation charges a tenant twice. Make writes
// idempotent (keyed by a request id or a lease generation) or drop them.
//
// # Key layout
//
// Every key starts with Config.KeyPrefix (default "llmproxy:") and carries
// the hash tag of its logical object, so that a script touching one object
// stays in one Redis Cluster slot (Client.Key):
//
//	<prefix>{instances}           sorted set: instance id → last heartbeat (ms, Redis clock)
//	<prefix>{instances}:<id>      string: one instance's last heartbeat, PX 3 × Refresh
//	<prefix>{breaker:<key>}:count, :reporters, :failures, :open, :recovered, :ratio, :probe, :probegen
//	                              a breaker key's fleet counts, open record (with the fleet's re-open
//	                              count), probe successes toward recovery, every instance's ratio
//	                              window sums and probe lease (breakers*.go, lease.go)
//	<prefix>breakers              channel: the open set's changes and the runs' starts and ends
//	<prefix>{tenant:<id>}:win, :leases, :hold:<req>, :done:<req>
//	                              a tenant's sliding window, concurrency leases, reservations and settlements (limits*.go)
//
// # Redis deployments
//
// Config.URL takes redis:// (plain), rediss:// (TLS),
// redis+sentinel://host:port[,host:port]/<master> (Sentinel) and
// redis+cluster://host:port[,host:port] (Redis Cluster). On a Cluster
// every script and transaction touches the keys of one hash tag only, the
// bulk reads are pipelines of single-key commands (go-redis splits them
// by node), and the breakers channel is plain PUBLISH/SUBSCRIBE, which a
// Cluster forwards to every node; go-redis follows MOVED and ASK within
// the operation's OpTimeout, and never replays a command whose connection
// failed after sending. A READONLY
// reply — a Sentinel failover that left connections on the old master, now
// a replica — replaces the go-redis client, so every connection is dialled
// again to the master the Sentinels name (at most once per Refresh); a
// Cluster client reloads its slot map instead.
// Scripts run through go-redis's Script (EVALSHA, then EVAL on NOSCRIPT),
// so a restarted Redis with an empty script cache costs one extra round
// trip and no error.
package fleet
