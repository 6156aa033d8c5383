package fleet

import "github.com/redis/go-redis/v9"

// The scripts of the shared breakers. Each touches the keys of one breaker
// key only, all under its hash tag {breaker:<key>}, and takes its times
// from Redis's clock (TIME; replicate_commands lets Redis before 5 write
// after it). Records and messages are JSON (cjson), so reasons and keys
// may hold any character.
//
//	KEYS of failureScript: count, reporters, failures, open, recovered,
//	ratio (putScript and clearScript take open, count, reporters,
//	failures, probe, recovered, ratio; successScript open, recovered,
//	probe, count, reporters, failures, ratio)
//
// An open record is {"s":"open","u":<until ms, 0: until closed>,"a":<set
// at ms>,"by":<instance>,"r":<reason>,"n":<the fleet's re-opens>}; the
// recovered counter holds the fleet's probe successes since the record was
// set (recovery_successes counted fleet-wide); a close leaves a tombstone
// {"s":"closed","a":…,"by":…} for the grace time, so that a late replay of
// an older write (after local mode) can tell that it is older.

// failureScript counts one failure of ARGV[1] (instance id) and opens the
// key when the fleet's counts fire a rule of the reporting breaker:
//
//	ARGV: id, member, consecutive (≤ 0: off), failures (0: off), window ms,
//	      min reporters, open_for ms, reason, idle ms, channel, key, grace ms,
//	      window as text
//
// It returns {"open", now} when the key is already open (not counted),
// {"counted", now, count}, or {"opened", now, ttl, reason}.
var failureScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local raw = redis.call('GET', KEYS[4])
if raw then
  local ok, r = pcall(cjson.decode, raw)
  if ok and type(r) == 'table' and r.s == 'open' and (r.u == 0 or r.u > now) then
    return {'open', now}
  end
end
local id = ARGV[1]
local cf, f = tonumber(ARGV[3]), tonumber(ARGV[4])
local win, minr = tonumber(ARGV[5]), tonumber(ARGV[6])
local idle = tonumber(ARGV[9])
local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], idle)
redis.call('SADD', KEYS[2], id)
redis.call('PEXPIRE', KEYS[2], idle)
redis.call('ZADD', KEYS[3], now, ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - win)
redis.call('ZREMRANGEBYRANK', KEYS[3], 0, -4097)
redis.call('PEXPIRE', KEYS[3], win)
local function gateways(k)
  if k == 1 then return '1 gateway' end
  return k .. ' gateways'
end
local why
if cf > 0 and n >= cf then
  local rep = redis.call('SCARD', KEYS[2])
  if rep >= minr then why = n .. ' consecutive failures from ' .. gateways(rep) end
end
if not why and f > 0 then
  local inwin = redis.call('ZCARD', KEYS[3])
  if inwin >= f then
    local seen, rep = {}, 0
    for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
      local who = string.match(m, '^[^:]*:(.*)$') or m
      if not seen[who] then
        seen[who] = true
        rep = rep + 1
      end
    end
    if rep >= minr then why = inwin .. ' failures within ' .. ARGV[13] .. ' from ' .. gateways(rep) end
  end
end
if not why then
  if n == 1 then
    redis.call('PUBLISH', ARGV[10], cjson.encode({t = 'dirty', k = ARGV[11], by = id}))
  end
  return {'counted', now, n}
end
local reason = 'fleet: ' .. why .. '; last: ' .. ARGV[8] .. ' (' .. id .. ')'
local ttl = tonumber(ARGV[7])
redis.call('SET', KEYS[4], cjson.encode({s = 'open', u = now + ttl, a = now, by = id, r = reason}),
  'PX', ttl + tonumber(ARGV[12]))
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[6])
redis.call('PUBLISH', ARGV[10], cjson.encode({t = 'trip', k = ARGV[11], by = id, a = now, ttl = ttl, r = reason}))
return {'opened', now, ttl, reason}
`)

// resetScript ends the fleet's consecutive run (a success): KEYS count,
// reporters; ARGV channel, key, id. It publishes "clean" when there was a
// run to end.
var resetScript = redis.NewScript(`
if redis.call('DEL', KEYS[1], KEYS[2]) > 0 then
  redis.call('PUBLISH', ARGV[1], cjson.encode({t = 'clean', k = ARGV[2], by = ARGV[3]}))
end
return 1
`)

// putScript records that the key is open (an operator, a Retry-After, a
// probe of a fleet verdict that failed, an observed trip) and starts the
// counts afresh:
//
//	ARGV: id, ttl ms (0: until closed), reason, grace ms, channel, key,
//	      at (0: now; a replay gives the time of the write, and a record
//	      set later wins), lease ("": none; else the write is the result
//	      of that probe lease's probe, and is dropped unless it is still
//	      the key's lease), reopens (the fleet's re-open count, kept in the
//	      record)
//
// Any write ends the key's probe lease and the recovery count. It returns {"put", now, at},
// {"stale", now} or {"expired", now}.
var putScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if ARGV[8] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[8] then return {'expired', now} end
local at = tonumber(ARGV[7])
if at > 0 then
  local raw = redis.call('GET', KEYS[1])
  if raw then
    local ok, r = pcall(cjson.decode, raw)
    if ok and type(r) == 'table' and tonumber(r.a) and r.a > at then return {'stale', now} end
  end
else
  at = now
end
local ttl = tonumber(ARGV[2])
local u = 0
if ttl > 0 then u = now + ttl end
local n = tonumber(ARGV[9]) or 0
local rec = cjson.encode({s = 'open', u = u, a = at, by = ARGV[1], r = ARGV[3], n = n})
if ttl > 0 then
  redis.call('SET', KEYS[1], rec, 'PX', ttl + tonumber(ARGV[4]))
else
  redis.call('SET', KEYS[1], rec)
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('PUBLISH', ARGV[5], cjson.encode({t = 'put', k = ARGV[6], by = ARGV[1], a = at, ttl = ttl, r = ARGV[3], n = n}))
return {'put', now, at}
`)

// clearScript records that the key closed and starts the counts afresh; it
// publishes "clear" only when the fleet had an open record (even one past
// its end: breakers that adopted it may still wait or probe):
//
//	ARGV: id, grace ms, channel, key, at (0: now; as putScript), lease
//	      (as putScript)
//
// It returns {"cleared", now}, {"none", now}, {"stale", now} or
// {"expired", now}.
var clearScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if ARGV[6] ~= '' and redis.call('GET', KEYS[5]) ~= ARGV[6] then return {'expired', now} end
local at = tonumber(ARGV[5])
local raw = redis.call('GET', KEYS[1])
local r
if raw then
  local ok, d = pcall(cjson.decode, raw)
  if ok and type(d) == 'table' then r = d end
end
if at > 0 then
  if r and tonumber(r.a) and r.a > at then return {'stale', now} end
else
  at = now
end
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('SET', KEYS[1], cjson.encode({s = 'closed', a = at, by = ARGV[1]}), 'PX', tonumber(ARGV[2]))
if r and r.s == 'open' then
  redis.call('PUBLISH', ARGV[3], cjson.encode({t = 'clear', k = ARGV[4], by = ARGV[1], a = at}))
  return {'cleared', now}
end
return {'none', now}
`)

// successScript counts one half-open probe success of ARGV[1] toward the
// fleet's recovery of an open key, and closes the key fleet-wide when the
// count reaches the reporting breaker's recovery_successes:
//
//	ARGV: id, recovery successes, lease ("": none; else the success is of
//	      that probe lease's probe, and is dropped unless it is still the
//	      key's lease), grace ms, channel, key, lease ms
//
// It returns {"none", now} when the key has no open record (a close came
// first), {"expired", now}, {"counted", now, n} or {"closed", now, n,
// reason}. A success counted under a lease moves the lease's end a lease
// time later, so that its holder sends the next recovery probe too (see
// lease.go). The close leaves the probe lease to expire (the winner's own
// close, which carries it, then finds the key closed), and publishes
// "clear" with the reason.
var successScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local raw = redis.call('GET', KEYS[1])
if not raw then return {'none', now} end
local ok, r = pcall(cjson.decode, raw)
if not ok or type(r) ~= 'table' or r.s ~= 'open' then return {'none', now} end
if ARGV[3] ~= '' and redis.call('GET', KEYS[3]) ~= ARGV[3] then return {'expired', now} end
local grace = tonumber(ARGV[4])
local n = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], grace)
if n < tonumber(ARGV[2]) then
  if ARGV[3] ~= '' then
    local left = redis.call('PTTL', KEYS[3])
    if left > 0 then redis.call('PEXPIRE', KEYS[3], left + tonumber(ARGV[7])) end
  end
  return {'counted', now, n}
end
local reason = n .. ' probe successes'
redis.call('DEL', KEYS[2], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
redis.call('SET', KEYS[1], cjson.encode({s = 'closed', a = now, by = ARGV[1]}), 'PX', grace)
redis.call('PUBLISH', ARGV[5], cjson.encode({t = 'clear', k = ARGV[6], by = ARGV[1], a = now, r = reason}))
return {'closed', now, n, reason}
`)

// ratioScript records one instance's sums of a breaker key's ratio window
// (FailureRatio, SlowRatio) and opens the key when the fleet's sums fire a
// ratio rule of the reporting breaker, with failures (slow calls for the
// slow rule) from at least min reporters instances:
//
//	KEYS: ratio, open, count, reporters, failures, recovered
//	ARGV: id, requests, failures, slow, fresh ms, min requests, failure
//	      ratio (0: off), slow ratio (0: off), min reporters, open_for ms,
//	      channel, key, grace ms, window as text
//
// The ratio hash holds "<at ms> <requests> <failures> <slow>" per
// instance; an instance with an empty window deletes its field, and a
// field older than fresh ms (an instance gone, or in local mode) is
// dropped. Sums sent while the key is open are not written: they were
// taken before the open, whose trip deleted the hash, and would count
// again in the first window after the key closes. It returns {"open", now} when the key is open already,
// {"summed", now, requests, failures, slow} or {"opened", now, ttl,
// reason}.
var ratioScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local id = ARGV[1]
local fresh = tonumber(ARGV[5])
local raw = redis.call('GET', KEYS[2])
if raw then
  local ok, r = pcall(cjson.decode, raw)
  if ok and type(r) == 'table' and r.s == 'open' and (r.u == 0 or r.u > now) then
    return {'open', now}
  end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[1], id, now .. ' ' .. ARGV[2] .. ' ' .. ARGV[3] .. ' ' .. ARGV[4])
  redis.call('PEXPIRE', KEYS[1], fresh)
else
  redis.call('HDEL', KEYS[1], id)
end
local req, fail, slow, frep, srep = 0, 0, 0, 0, 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local at, q, f, s = string.match(all[i + 1], '^(%d+) (%d+) (%d+) (%d+)$')
  if not at or tonumber(at) < now - fresh then
    redis.call('HDEL', KEYS[1], all[i])
  else
    req, fail, slow = req + tonumber(q), fail + tonumber(f), slow + tonumber(s)
    if tonumber(f) > 0 then frep = frep + 1 end
    if tonumber(s) > 0 then srep = srep + 1 end
  end
end
local minq, fr, sr, minr = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
local function gateways(k)
  if k == 1 then return '1 gateway' end
  return k .. ' gateways'
end
local why
if req >= minq then
  if fr > 0 and fail >= fr * req and frep >= minr then
    why = string.format('failure ratio %d/%d ≥ %s within %s from %s', fail, req, ARGV[7], ARGV[14], gateways(frep))
  elseif sr > 0 and slow >= sr * req and srep >= minr then
    why = string.format('slow call ratio %d/%d ≥ %s within %s from %s', slow, req, ARGV[8], ARGV[14], gateways(srep))
  end
end
if not why then return {'summed', now, req, fail, slow} end
local reason = 'fleet: ' .. why .. ' (' .. id .. ')'
local ttl = tonumber(ARGV[10])
redis.call('SET', KEYS[2], cjson.encode({s = 'open', u = now + ttl, a = now, by = id, r = reason}),
  'PX', ttl + tonumber(ARGV[13]))
redis.call('DEL', KEYS[1], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('PUBLISH', ARGV[11], cjson.encode({t = 'trip', k = ARGV[12], by = id, a = now, ttl = ttl, r = reason}))
return {'opened', now, ttl, reason}
`)

// breakerMsg is one message on the breakers channel.
type breakerMsg struct {
	// T is "trip" (the fleet's counts opened the key), "put" (an instance
	// opened it), "clear" (an instance closed it), "dirty" (the fleet's
	// consecutive count went from 0 to 1) or "clean" (a success ended it).
	T string `json:"t"`
	// K is the breaker key.
	K string `json:"k"`
	// By is the instance that wrote.
	By string `json:"by"`
	// A is when the record was set, ms on Redis's clock.
	A int64 `json:"a,omitempty"`
	// TTL is the open time remaining, ms; 0 with "put": until closed.
	TTL int64 `json:"ttl,omitempty"`
	// R is the reason.
	R string `json:"r,omitempty"`
	// N is the fleet's re-open count ("put").
	N int `json:"n,omitempty"`
}

// openRecord is the value of a key's open record.
type openRecord struct {
	S  string `json:"s"` // "open" or "closed" (a tombstone)
	U  int64  `json:"u"` // until, ms on Redis's clock; 0: until closed
	A  int64  `json:"a"` // set at, ms on Redis's clock
	By string `json:"by"`
	R  string `json:"r"`
	N  int    `json:"n,omitempty"` // the fleet's re-opens since the key last closed
}

// openAt reports whether the record says open at now (ms, Redis's clock).
func (r openRecord) openAt(now int64) bool { return r.S == "open" && (r.U == 0 || r.U > now) }
