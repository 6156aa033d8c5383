package fleet

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/llmproxy/caddy-llm-proxy/breaker"
)

// breakerKeys are the Redis keys of one breaker key, in the order
// failureScript takes them: count, reporters, failures, open, recovered,
// ratio.
func (bs *Breakers) breakerKeys(key string) []string {
	obj := "breaker:" + key
	return []string{
		bs.c.Key(obj, "count"),
		bs.c.Key(obj, "reporters"),
		bs.c.Key(obj, "failures"),
		bs.c.Key(obj, "open"),
		bs.c.Key(obj, "recovered"),
		bs.c.Key(obj, "ratio"),
	}
}

// work is the background worker: it sends the queued reports, writes the
// pending writes, and reads the open set every Refresh (and when asked).
func (bs *Breakers) work() {
	defer bs.wg.Done()
	t := time.NewTicker(bs.c.cfg.Refresh)
	defer t.Stop()
	for {
		select {
		case <-bs.stop:
			return
		case r := <-bs.queue:
			bs.send(r)
		case <-bs.wake:
			bs.writeAll()
		case <-bs.refreshNow:
			bs.sync()
		case <-t.C:
			bs.sync()
		case <-bs.leaseNow:
			if !bs.c.Degraded() {
				bs.leases()
			}
		}
		bs.flush()
	}
}

// sync is the periodic work, and the reconciliation after local mode: the
// pending writes (replays), then the bulk refresh.
func (bs *Breakers) sync() {
	if bs.c.Degraded() {
		return
	}
	bs.writeAll()
	bs.refresh()
	bs.flush() // the refresh's verdicts first: the lease looks at the breakers' states
	bs.leases()
	bs.ratios()
}

// hasRatioRule reports whether b has FailureRatio or SlowRatio on.
func hasRatioRule(b *breaker.Breaker) bool {
	s := b.Settings()
	return s.FailureRatio > 0 || s.SlowRatio > 0
}

// ratioMember returns the breaker of ms whose ratio window the fleet's
// ratio rules read: one with a ratio rule that is closed, or open by its
// own rules alone (a local trip: its window is evidence the fleet has not
// decided on); the one with the most requests when several breakers of
// the key live here (a reload's old and new); nil if none. A breaker open
// or half-open on a fleet verdict is left out: its window still holds what
// opened the key, and is fresh again once it closes. It may take the
// breakers' locks: never call it under bs.mu.
func ratioMember(ms []*breaker.Breaker) *breaker.Breaker {
	var best *breaker.Breaker
	most := -1
	for _, b := range ms {
		if !hasRatioRule(b) {
			continue
		}
		if b.State() != breaker.Closed && !b.Snapshot().Local {
			continue
		}
		if n := b.RatioCounts().Requests; n > most {
			best, most = b, n
		}
	}
	return best
}

// ratios writes this instance's ratio window sums of every key with a
// ratio rule here that the fleet does not have open.
func (bs *Breakers) ratios() {
	now := time.Now()
	var keys []string
	bs.mu.Lock()
	for key, k := range bs.keys {
		if !k.openAt(now) && slices.ContainsFunc(k.members, hasRatioRule) {
			keys = append(keys, key)
		}
	}
	bs.mu.Unlock()
	for _, key := range keys {
		bs.sendRatio(key, 0)
	}
}

// sendRatio writes this instance's sums of key's ratio window, unless
// they were written less than every ago, or they are zero and so were the
// last ones; a rule that fires opens the key as a trip does.
func (bs *Breakers) sendRatio(key string, every time.Duration) {
	now := time.Now()
	bs.mu.Lock()
	k, ok := bs.keys[key]
	if !ok || bs.closed || (every > 0 && now.Sub(k.ratioAt) < every) {
		bs.mu.Unlock()
		return
	}
	ms := slices.Clone(k.members)
	sent := k.ratioSent
	bs.mu.Unlock()
	b := ratioMember(ms)
	if b == nil {
		return
	}
	rc := b.RatioCounts()
	if rc.Requests == 0 && !sent {
		return
	}
	bs.mu.Lock()
	if k, ok := bs.keys[key]; ok {
		k.ratioAt = now
	}
	bs.mu.Unlock()
	s := b.Settings()
	keys := bs.breakerKeys(key)
	fresh := 3 * bs.c.cfg.Refresh
	res, err := bs.do("breaker_ratio", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
		return runScript(ratioScript, ctx, c, []string{keys[5], keys[3], keys[0], keys[1], keys[2], keys[4]},
			bs.id, rc.Requests, rc.Failures, rc.Slow, fresh.Milliseconds(), s.MinRequests,
			strconv.FormatFloat(s.FailureRatio, 'g', -1, 64), strconv.FormatFloat(s.SlowRatio, 'g', -1, 64),
			bs.c.cfg.MinReporters, max(s.OpenFor, time.Millisecond).Milliseconds(), bs.channel, key,
			breakerGrace.Milliseconds(), s.RatioWindow.String())
	})
	if err != nil {
		bs.logError("breaker_ratio", key, err)
		return
	}
	bs.mu.Lock()
	if k, ok := bs.keys[key]; ok {
		// Sums sent while the key was open were not written.
		k.ratioSent = rc.Requests > 0 && (len(res) == 0 || res[0] != "open")
	}
	bs.mu.Unlock()
	if len(res) >= 4 && res[0] == "opened" {
		ttl, _ := res[2].(int64)
		at, _ := res[1].(int64)
		reason, _ := res[3].(string)
		bs.applyOpen(breakerMsg{T: "trip", K: key, By: bs.id, A: at, TTL: ttl, R: reason}, time.Now())
	}
}

// modeChanged is the client's hook: into local mode the queue is dropped;
// back in fleet mode the worker reconciles at once and the subscription is
// made again (its connection may have been dead all along).
func (bs *Breakers) modeChanged(degraded bool) {
	if degraded {
		for {
			select {
			case <-bs.queue:
			default:
				return
			}
		}
	}
	go bs.closeSub() // not on the client's loop: a dial in progress holds the subscription's lock
	poke(bs.refreshNow)
}

// do runs one operation through the client and notes Redis's clock from
// the reply's "now" (its second element).
func (bs *Breakers) do(op string, fn func(ctx context.Context, r redis.Cmdable) ([]any, error)) ([]any, error) {
	var res []any
	start := time.Now()
	err := bs.c.Do(context.Background(), op, func(ctx context.Context, r redis.Cmdable) error {
		var err error
		res, err = fn(ctx, r)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(res) >= 2 {
		if now, ok := res[1].(int64); ok {
			bs.noteClock(now, start, time.Now())
		}
	}
	return res, nil
}

func (bs *Breakers) noteClock(redisNow int64, sent, got time.Time) {
	mid := sent.Add(got.Sub(sent) / 2)
	bs.offset.Store(redisNow - mid.UnixMilli())
}

// redisMillis converts a time of this instance to ms on Redis's clock.
func (bs *Breakers) redisMillis(t time.Time) int64 { return t.UnixMilli() + bs.offset.Load() }

func runScript(s *redis.Script, ctx context.Context, r redis.Cmdable, keys []string, args ...any) ([]any, error) {
	v, err := s.Run(ctx, r, keys, args...).Result()
	if err != nil {
		return nil, err
	}
	res, ok := v.([]any)
	if !ok {
		return nil, fmt.Errorf("unexpected script reply %v", v)
	}
	return res, nil
}

// send writes one queued report. A failure that fails is not replayed: it
// may have been counted (an ambiguous timeout), and a count replayed opens
// the key early.
func (bs *Breakers) send(r report) {
	if bs.c.Degraded() {
		return
	}
	keys := bs.breakerKeys(r.key)
	if r.reset {
		_, err := bs.do("breaker_reset", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
			return nil, resetScript.Run(ctx, c, keys[:2], bs.channel, r.key, bs.id).Err()
		})
		bs.logError("breaker_reset", r.key, err)
		return
	}
	if r.success {
		bs.sendSuccess(r, keys)
		return
	}
	member := bs.nonce + strconv.FormatUint(bs.seq.Add(1), 36) + ":" + bs.id
	window := r.window
	if window <= 0 {
		window = time.Millisecond
	}
	res, err := bs.do("breaker_failure", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
		return runScript(failureScript, ctx, c, keys,
			bs.id, member, r.consec, r.failures, window.Milliseconds(), bs.c.cfg.MinReporters,
			max(r.openFor, time.Millisecond).Milliseconds(), reasonOr(r.reason, "failure"), breakerIdleTTL.Milliseconds(),
			bs.channel, r.key, breakerGrace.Milliseconds(), r.window.String())
	})
	if err != nil {
		bs.logError("breaker_failure", r.key, err)
		return
	}
	if len(res) >= 4 && res[0] == "opened" {
		now, _ := res[1].(int64)
		ttl, _ := res[2].(int64)
		reason, _ := res[3].(string)
		bs.applyOpen(breakerMsg{T: "trip", K: r.key, By: bs.id, A: now, TTL: ttl, R: reason}, time.Now())
		return
	}
	if len(res) > 0 && res[0] == "counted" {
		bs.sendRatio(r.key, bs.c.cfg.Refresh/5) // the fleet's ratio with this failure
	}
}

// sendSuccess writes one probe success; like a failure it is not
// replayed (a replayed success closes the key early). One counted under a
// lease extends the lease by r.leaseTTL (successScript).
func (bs *Breakers) sendSuccess(r report, keys []string) {
	probe := bs.c.Key("breaker:"+r.key, "probe")
	res, err := bs.do("breaker_success", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
		return runScript(successScript, ctx, c, []string{keys[3], keys[4], probe, keys[0], keys[1], keys[2], keys[5]},
			bs.id, r.recov, r.lease, breakerGrace.Milliseconds(), bs.channel, r.key, r.leaseTTL.Milliseconds())
	})
	if err != nil {
		bs.logError("breaker_success", r.key, err)
		return
	}
	if len(res) >= 4 && res[0] == "closed" {
		reason, _ := res[3].(string)
		bs.applyClear(breakerMsg{T: "clear", K: r.key, By: bs.id, R: reason}, time.Now())
	}
}

// applyClear applies a close of the fleet: this instance forgets the open
// record and every breaker of the key closes.
func (bs *Breakers) applyClear(m breakerMsg, now time.Time) {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	k, ok := bs.keys[m.K]
	if !ok || bs.closed || bs.supersededLocked(m.K) {
		return
	}
	k.open, k.until, k.reason, k.by, k.at, k.changed = false, time.Time{}, "", "", 0, now
	k.reopens = 0
	k.dirty.Store(false)
	k.lease = "" // the close ended it
	bs.armLocked(k, time.Time{})
	reason := "closed in fleet by " + m.By
	if m.R != "" {
		reason += ": " + m.R
	}
	bs.pushLocked(k, false, time.Time{}, reason, false)
	bs.forgetLocked(m.K, k, now)
}

func reasonOr(r, def string) string {
	if r == "" {
		return def
	}
	return r
}

// writeAll writes the pending PutOpen and ClearOpen, the newest per key. A
// write that fails on Redis's side (a timeout, a lost connection, local
// mode) stays pending, marked as a replay; one Redis refused is dropped.
func (bs *Breakers) writeAll() {
	if bs.c.Degraded() {
		return
	}
	bs.mu.Lock()
	pending := make(map[string]*write, len(bs.writes))
	for k, w := range bs.writes {
		pending[k] = w
	}
	bs.mu.Unlock()
	for key, w := range pending {
		res, err := bs.writeOne(key, w)
		expired := err == nil && len(res) > 0 && res[0] == "expired"
		count := expired
		bs.mu.Lock()
		if k, ok := bs.keys[key]; ok && expired {
			if k.expired == w.lease {
				count = false // counted when the lease went to another instance
			} else {
				k.expired = w.lease
			}
		}
		if bs.writes[key] == w {
			if err != nil && KindOf(err).unhealthy() || errors.Is(err, ErrDegraded) {
				w.replay = true
			} else if expired {
				// A probe's result from a lease that ran out: dropped. The
				// breaker keeps its own state until the fleet's record
				// says otherwise; this instance's copy does not claim it.
				delete(bs.writes, key)
				if k, ok := bs.keys[key]; ok {
					if w.open && k.open && k.by == bs.id && k.at == 0 {
						k.open, k.until, k.reason, k.by = false, time.Time{}, "", ""
						bs.armLocked(k, time.Time{})
					}
					bs.forgetLocked(key, k, time.Now())
				}
			} else {
				delete(bs.writes, key)
				if k, ok := bs.keys[key]; ok {
					if w.open && err == nil && len(res) >= 3 && res[0] == "put" && k.open && k.by == bs.id {
						k.at, _ = res[2].(int64)
					}
					bs.forgetLocked(key, k, time.Now())
				}
			}
		}
		bs.mu.Unlock()
		if count && bs.onLease != nil {
			bs.onLease(LeaseExpired)
		}
		if err != nil && !errors.Is(err, ErrDegraded) {
			bs.logError("breaker_write", key, err)
		}
	}
}

// writeOne runs a pending write's script. A put whose time is over is
// dropped (nil, nil).
func (bs *Breakers) writeOne(key string, w *write) ([]any, error) {
	keys := bs.breakerKeys(key)
	probe := bs.c.Key("breaker:"+key, "probe")
	var at int64
	if w.replay {
		at = bs.redisMillis(w.made)
	}
	if !w.open {
		return bs.do("breaker_close", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
			return runScript(clearScript, ctx, c, []string{keys[3], keys[0], keys[1], keys[2], probe, keys[4], keys[5]},
				bs.id, breakerGrace.Milliseconds(), bs.channel, key, at, w.lease)
		})
	}
	var ttl int64
	if !w.until.IsZero() {
		if ttl = time.Until(w.until).Milliseconds(); ttl <= 0 {
			return nil, nil
		}
	}
	return bs.do("breaker_open", func(ctx context.Context, c redis.Cmdable) ([]any, error) {
		return runScript(putScript, ctx, c, []string{keys[3], keys[0], keys[1], keys[2], probe, keys[4], keys[5]},
			bs.id, ttl, w.reason, breakerGrace.Milliseconds(), bs.channel, key, at, w.lease, w.reopens)
	})
}

// refresh reads the open record and the consecutive count of every key
// known here in one round trip, and brings this instance's copy up to
// date (see Breakers).
func (bs *Breakers) refresh() {
	bs.mu.Lock()
	keys := make([]string, 0, len(bs.keys))
	for k := range bs.keys {
		keys = append(keys, k)
	}
	bs.mu.Unlock()
	if len(keys) == 0 {
		return
	}
	start := time.Now()
	var clock *redis.TimeCmd
	recs := make([]*redis.StringCmd, len(keys))
	counts := make([]*redis.StringCmd, len(keys))
	err := bs.c.Do(context.Background(), "breaker_refresh", func(ctx context.Context, r redis.Cmdable) error {
		_, err := r.Pipelined(ctx, func(p redis.Pipeliner) error {
			clock = p.Time(ctx)
			for i, k := range keys {
				rk := bs.breakerKeys(k)
				counts[i] = p.Get(ctx, rk[0])
				recs[i] = p.Get(ctx, rk[3])
			}
			return nil
		})
		if errors.Is(err, redis.Nil) {
			err = nil
		}
		return err
	})
	got := time.Now()
	if err != nil {
		bs.logError("breaker_refresh", "", err)
		return
	}
	rt, err := clock.Result()
	if err != nil {
		return
	}
	redisNow := rt.UnixMilli()
	bs.noteClock(redisNow, start, got)

	bs.mu.Lock()
	var lost []string
	for i, key := range keys {
		k, ok := bs.keys[key]
		if !ok || k.changed.After(start) || bs.writes[key] != nil {
			continue // changed here since, or about to be: this read is older
		}
		n, _ := counts[i].Int64()
		k.dirty.Store(n > 0)
		var rec openRecord
		if raw, err := recs[i].Result(); err == nil {
			_ = json.Unmarshal([]byte(raw), &rec)
		}
		switch {
		case rec.openAt(redisNow):
			var until time.Time
			if rec.U != 0 {
				until = got.Add(time.Duration(rec.U-redisNow) * time.Millisecond)
			}
			k.reopens = rec.N
			if k.open && k.at == rec.A && k.by == rec.By {
				// Known: only breakers that are closed while the fleet
				// says open (created, or back from local mode) adopt it.
				bs.pushLocked(k, true, k.until, k.reason, true)
				continue
			}
			k.open, k.until, k.reason, k.by, k.at = true, until, rec.R, rec.By, rec.A
			k.dirty.Store(false)
			k.lease = "" // a new record: any write ended the lease
			bs.pushLocked(k, true, until, rec.R, false)
			bs.armLocked(k, until)
		case !k.open:
		case !k.openAt(got):
			k.open, k.until, k.reason, k.by, k.at = false, time.Time{}, "", "", 0 // over
		case k.by == bs.id && (rec.S == "" || rec.A < k.at):
			// The fleet lost this instance's open (Redis restarted empty),
			// or has only an older close: write it again, as a replay, so
			// that a record set after it still wins.
			if k.at != 0 {
				lost = append(lost, key)
				bs.writes[key] = &write{open: true, until: k.until, reason: k.reason,
					made: time.UnixMilli(k.at - bs.offset.Load()), replay: true}
			}
		case k.by == bs.id && rec.S == "open" && rec.A == k.at:
			// This instance's, ending by Redis's clock a moment earlier.
		default:
			// Closed in the fleet (a message missed): forgotten. The
			// breakers that adopted it end their open time on their own.
			k.open, k.until, k.reason, k.by, k.at = false, time.Time{}, "", "", 0
			k.lease = ""
			k.reopens = 0
		}
		bs.forgetLocked(key, k, got)
	}
	bs.mu.Unlock()
	if len(lost) > 0 {
		bs.writeAll()
	}
}

// applyOpen applies a trip or a put: the key opens here until now + TTL
// and every breaker of it adopts the verdict.
func (bs *Breakers) applyOpen(m breakerMsg, now time.Time) {
	var until time.Time
	if m.TTL > 0 {
		until = now.Add(time.Duration(m.TTL) * time.Millisecond)
	} else if m.T == "trip" {
		return
	}
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if bs.closed {
		return
	}
	if bs.supersededLocked(m.K) {
		return
	}
	k := bs.keyLocked(m.K)
	k.dirty.Store(false)
	if k.open && k.at == m.A && k.by == m.By {
		return // known: the script's reply and its message
	}
	k.open, k.until, k.reason, k.by, k.at, k.changed = true, until, m.R, m.By, m.A, now
	k.reopens = m.N // a trip: 0
	k.lease = ""    // a new record: its write ended the lease
	bs.pushLocked(k, true, until, m.R, false)
	bs.armLocked(k, until)
}

// supersededLocked reports whether this instance has a write of key on its
// way (not a replay): it is newer than any message, and will override it.
func (bs *Breakers) supersededLocked(key string) bool {
	w := bs.writes[key]
	return w != nil && !w.replay
}

// apply applies one message from the channel. This instance's own puts
// and clears were applied when they were made.
func (bs *Breakers) apply(payload string) {
	var m breakerMsg
	if err := json.Unmarshal([]byte(payload), &m); err != nil || m.K == "" {
		return
	}
	now := time.Now()
	switch m.T {
	case "trip":
		bs.applyOpen(m, now)
	case "put":
		if m.By != bs.id {
			bs.applyOpen(m, now)
		}
	case "clear":
		if m.By == bs.id {
			return
		}
		bs.applyClear(m, now)
	case "dirty", "clean":
		bs.mu.Lock()
		if k, ok := bs.keys[m.K]; ok && !bs.closed {
			k.dirty.Store(m.T == "dirty")
			k.changed = now
		}
		bs.mu.Unlock()
	}
	bs.flush()
}

// subscribe keeps a subscription to the breakers channel, made again on a
// new connection whenever the current one fails, stops answering (a ping
// unanswered for a Refresh), or the client replaced its connections.
func (bs *Breakers) subscribe() {
	defer bs.wg.Done()
	for {
		select {
		case <-bs.stop:
			return
		default:
		}
		rdb := bs.c.rdb.Load()
		ps := rdb.Subscribe(context.Background())
		if !bs.setSub(ps) {
			_ = ps.Close()
			return
		}
		bs.listen(ps, rdb)
		bs.closeSub()
		select {
		case <-bs.stop:
			return
		case <-time.After(bs.c.cfg.Refresh / 2):
		}
	}
}

func (bs *Breakers) listen(ps *redis.PubSub, rdb *rdbConn) {
	ctx := context.Background()
	if err := ps.Subscribe(ctx, bs.channel); err != nil {
		return
	}
	pinged := false
	for bs.c.rdb.Load() == rdb {
		msg, err := ps.ReceiveTimeout(ctx, bs.c.cfg.Refresh)
		if err != nil {
			var ne net.Error
			if !errors.As(err, &ne) || !ne.Timeout() || pinged {
				return // broken, or silent for a ping's round: a new connection
			}
			if ps.Ping(ctx) != nil {
				return
			}
			pinged = true
			continue
		}
		pinged = false
		switch m := msg.(type) {
		case *redis.Subscription:
			if m.Kind == "subscribe" {
				poke(bs.refreshNow) // messages may have been missed until now
			}
		case *redis.Message:
			bs.apply(m.Payload)
		}
	}
}

// setSub makes ps the current subscription, false after Close.
func (bs *Breakers) setSub(ps *redis.PubSub) bool {
	bs.subMu.Lock()
	defer bs.subMu.Unlock()
	select {
	case <-bs.stop:
		return false
	default:
	}
	bs.sub = ps
	return true
}

// closeSub closes the current subscription, so that its listener makes a
// new one (or stops, after Close).
func (bs *Breakers) closeSub() {
	bs.subMu.Lock()
	defer bs.subMu.Unlock()
	if bs.sub != nil {
		_ = bs.sub.Close()
		bs.sub = nil
	}
}

// logError logs a failed operation at debug level: the client counts
// failures and logs the switch to local mode; a script error (a bug) is a
// warning.
func (bs *Breakers) logError(op, key string, err error) {
	if err == nil || errors.Is(err, ErrDegraded) || errors.Is(err, ErrClosed) {
		return
	}
	level := bs.c.log.Debug
	if KindOf(err) == KindScript {
		level = bs.c.log.Warn
	}
	level("fleet breaker store: operation failed", zap.String("op", op), zap.String("breaker", key), zap.Error(err))
}
