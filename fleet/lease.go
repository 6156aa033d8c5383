package fleet

import (
	"context"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// The probe lease (DESIGN §9): while a key is open in the
// fleet, one gateway per lease time probes it — the half-open user probe or
// the active prober — and the others keep refusing until the result is
// published. Without it, every gateway's breakers half-open at the end of
// the fleet's open time and the whole fleet probes a recovering server at
// once.
//
//   - Gating: the breakers here adopt a fleet open until its end plus the
//     key's lease time (gateLocked), so none half-opens on its own at the
//     end (in local mode they do, a lease time late: never wedged).
//   - The lease: at the end (a timer) and on every refresh after it, for
//     each key whose fleet record is open and past its end and whose
//     breakers here are still open on the fleet's verdict, leaseScript
//     takes <prefix>{breaker:<key>}:probe = "<instance>:<gen>" (SET NX PX,
//     gen from INCR …:probegen). The winner's breakers get ProbeNow: they
//     half-open on their next call or active probe. A loser's breakers get
//     Adopt(now + lease time): they keep refusing, renewed every refresh
//     while the lease is held. A winner that dies leaves a lease that
//     expires, and the next refresh gives it to another instance.
//   - The result: the winner's breaker recovers (ClearOpen) or re-opens
//     (PutOpen); that write carries the lease, and its script applies it
//     only while the lease is still the key's (any write then ends the
//     lease). A result from a lease that ran out is dropped and counted
//     "expired"; the breaker keeps its own state until the fleet's record
//     says otherwise.
//
// Any PutOpen or ClearOpen of this instance made while it holds the lease
// is taken as the probe's result (the store cannot tell an operator's
// action on this gateway from it); within the lease time only.
//
// Recovery (recovery_successes above 1) stays with the holder: each
// success counted under the lease moves the lease's end one lease time
// later (successScript), so the holder sends the next recovery probe too:
// the next user request at once, or its active prober's next probe one
// probe interval later, which a lease of at most that interval then still
// covers. So the fleet recovers as one gateway would, one prober at a
// time: recovery_successes 2 closes the key about one probe interval
// after the first probe, not one lease round per success, and no probe
// is sent past its lease (before, a lease equal to the interval ran out
// just before the holder's second probe, whose success was dropped, and
// another gateway probed again). It stays bounded: the lease grows only
// with counted successes, by a lease time each and recovery_successes − 1
// times at most (the last one closes the key), and a holder that stops
// probing loses it when the extended lease runs out.
//
// A winner's breaker that is still half-open when its lease runs out (it
// sent no probe within the extended lease) takes part in the next round
// like the open ones: it keeps probing if it wins the lease again, and
// goes back to open (Adopt until the new holder's lease ends) if another
// instance won, so every success counted toward the fleet's recovery
// carries a live lease. One whose probe slots are all taken (a probe still
// out) only looks: it does not take the lease, and goes back to open, its
// probe's result dropped (counted "expired"), when another instance holds
// it.

// Outcomes of the probe lease, for BreakersOptions.OnLease.
const (
	LeaseWon     = "won"
	LeaseLost    = "lost"
	LeaseExpired = "expired"
)

// probeGenTTL is how long a key's lease generation counter outlives its
// last lease: a result older than this is long past its lease anyway.
const probeGenTTL = 24 * time.Hour

// leaseTTLLocked is key's lease time: LeaseTTL, at most 0.8 × the shortest
// OpenFor of its breakers here, at least 2 × Refresh.
func (bs *Breakers) leaseTTLLocked(k *keyState) time.Duration {
	ttl := bs.lease
	for _, b := range k.members {
		if of := b.Settings().OpenFor * 8 / 10; of > 0 && of < ttl {
			ttl = of
		}
	}
	return max(ttl, 2*bs.c.cfg.Refresh)
}

// gateLocked is until which the breakers here adopt a fleet open ending at
// until: a lease time later (zero stays zero: until closed).
func (bs *Breakers) gateLocked(k *keyState, until time.Time) time.Time {
	if until.IsZero() {
		return until
	}
	return until.Add(bs.leaseTTLLocked(k))
}

// armLocked sets key's timer to try the lease just after until (zero, or
// after Close: no timer).
func (bs *Breakers) armLocked(k *keyState, until time.Time) {
	if k.timer != nil {
		k.timer.Stop()
		k.timer = nil
	}
	if until.IsZero() || bs.closed {
		return
	}
	k.timer = time.AfterFunc(time.Until(until)+10*time.Millisecond, func() { poke(bs.leaseNow) })
}

// leaseCandidate is a key whose breakers here wait for a probe lease.
type leaseCandidate struct {
	key     string
	members []*breaker.Breaker
	ttl     time.Duration
}

// leases tries the probe lease of every key whose fleet open is over here
// and whose breakers are still open, and pushes the outcome to them.
func (bs *Breakers) leases() {
	now := time.Now()
	var cands []leaseCandidate
	bs.mu.Lock()
	if bs.closed {
		bs.mu.Unlock()
		return
	}
	for key, k := range bs.keys {
		if k.openAt(now) {
			continue // not over yet here; its timer comes
		}
		var ms []*breaker.Breaker
		for _, b := range k.members {
			if st := b.State(); st == breaker.Open || st == breaker.HalfOpen {
				ms = append(ms, b)
			}
		}
		if len(ms) > 0 {
			cands = append(cands, leaseCandidate{key: key, members: ms, ttl: bs.leaseTTLLocked(k)})
		}
	}
	bs.mu.Unlock()
	for _, c := range cands {
		// Only breakers open or half-open on the fleet's verdict: a local
		// trip probes on its own, one forced open until closed waits for
		// a close, and an observed trip recovers by observations.
		ms := c.members[:0]
		peek := true // every breaker here is half-open with no free probe slot
		for _, b := range c.members {
			snap := b.Snapshot()
			if snap.Local || snap.Observed {
				continue
			}
			switch {
			case snap.State == breaker.Open && !snap.OpenUntil.IsZero():
				peek = false
			case snap.State == breaker.HalfOpen:
				peek = peek && snap.ProbesInFlight >= b.Settings().HalfOpenProbes
			default:
				continue
			}
			ms = append(ms, b)
		}
		if len(ms) > 0 {
			bs.tryLease(c.key, ms, c.ttl, peek)
		}
	}
	bs.flush()
}

// tryLease runs the lease script of key and queues the outcome for ms;
// peek only looks at the holder (it takes no free lease).
func (bs *Breakers) tryLease(key string, ms []*breaker.Breaker, ttl time.Duration, peek bool) {
	obj := "breaker:" + key
	keys := []string{bs.c.Key(obj, "open"), bs.c.Key(obj, "probe"), bs.c.Key(obj, "probegen")}
	look := "0"
	if peek {
		look = "1"
	}
	res, err := bs.do("breaker_lease", func(ctx context.Context, r redis.Cmdable) ([]any, error) {
		return runScript(leaseScript, ctx, r, keys, bs.id, ttl.Milliseconds(), probeGenTTL.Milliseconds(), look)
	})
	if err != nil {
		bs.logError("breaker_lease", key, err)
		return
	}
	if len(res) < 3 {
		return // "none": not open in the fleet, or not over
	}
	now := time.Now()
	var result string
	expired := false
	bs.mu.Lock()
	k, ok := bs.keys[key]
	if !ok || bs.closed {
		bs.mu.Unlock()
		return
	}
	switch res[0] {
	case "won":
		gen, _ := res[2].(int64)
		k.lease = bs.id + ":" + strconv.FormatInt(gen, 10)
		for _, b := range ms {
			bs.outbox = append(bs.outbox, push{b: b, probe: true, reason: "probe lease won by " + bs.id})
		}
		result = LeaseWon
	case "held":
		holder, _ := res[2].(string)
		who := holder
		if i := strings.LastIndexByte(holder, ':'); i >= 0 {
			who = holder[:i]
		}
		if holder == k.lease || who == bs.id {
			// Ours: its breakers probe already, or a write of this
			// instance that carries it (the probe's result) is on its way
			// and ends it; a round that ran before that write must not
			// push the breakers that wrote it back to open.
			break
		}
		for _, b := range ms {
			bs.outbox = append(bs.outbox, push{b: b, open: true, until: now.Add(ttl), reason: "probe lease held by " + who})
		}
		if k.lost != holder {
			k.lost = holder
			result = LeaseLost
		}
		if k.lease != "" && k.expired != k.lease && probeOut(ms) {
			// This instance's lease ran out with a probe of it still
			// out: what that probe brings is dropped.
			k.expired = k.lease
			expired = true
		}
	}
	bs.mu.Unlock()
	if bs.onLease != nil {
		if result != "" {
			bs.onLease(result)
		}
		if expired {
			bs.onLease(LeaseExpired)
		}
	}
}

// probeOut reports whether any of ms is half-open with a probe out.
func probeOut(ms []*breaker.Breaker) bool {
	for _, b := range ms {
		if b.State() == breaker.HalfOpen && b.Snapshot().ProbesInFlight > 0 {
			return true
		}
	}
	return false
}

// leaseScript takes a key's probe lease when the key's fleet record is open
// and past its end and nobody holds the lease:
//
//	KEYS: open, probe, probegen
//	ARGV: id, lease ms, generation counter ms, peek ("1": only report the
//	      holder, take no free lease)
//
// It returns {"won", now, gen} (the lease is "<id>:<gen>"), {"held", now,
// lease} or {"none", now}.
var leaseScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local raw = redis.call('GET', KEYS[1])
if not raw then return {'none', now} end
local ok, r = pcall(cjson.decode, raw)
if not ok or type(r) ~= 'table' or r.s ~= 'open' or not tonumber(r.u) or r.u == 0 or r.u > now then
  return {'none', now}
end
local cur = redis.call('GET', KEYS[2])
if cur then return {'held', now, cur} end
if ARGV[4] == '1' then return {'none', now} end
local gen = redis.call('INCR', KEYS[3])
redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[3]))
redis.call('SET', KEYS[2], ARGV[1] .. ':' .. gen, 'PX', tonumber(ARGV[2]))
return {'won', now, gen}
`)
