package fleet

import "github.com/redis/go-redis/v9"

// The tenant-limit scripts (DESIGN §9). Every key of a tenant
// carries its hash tag, {tenant:<id>}, so each script touches one Redis
// Cluster slot:
//
//	<prefix>{tenant:<id>}:win          hash: the rolling window (below)
//	<prefix>{tenant:<id>}:leases       sorted set: lease id → expiry (ms, Redis clock)
//	<prefix>{tenant:<id>}:hold:<rid>   string "<slot> <reserved>": what a live request took
//	<prefix>{tenant:<id>}:done:<rid>   string: the request is settled (SET NX: a replay is a no-op)
//
// The window is a sliding window of 60 slots (one second each for a
// minute), the same as a gateway's local one: fields r<slot> and t<slot>
// count the requests and tokens of each slot, R and T their totals, o the
// oldest slot still kept, n the newest written, nr and nt the newest with
// requests and tokens (for the reset headers). A script first forgets the
// slots that have left the window (at most 60, usually none or one). Slots
// are counted on Redis's clock (TIME), never the caller's.
//
// A sliding window rather than GCRA: a GCRA bucket lets a tenant at rest
// spend its whole limit at once and then its refill within the same minute
// (up to twice the limit in a rolling minute), while operators (and the
// x-ratelimit-* headers) read rpm as "at most this many in any minute";
// and a tpm reservation must be given back to the slot it was counted in,
// exactly, when it settles — a bucket forgets where a charge came from. It
// also makes the fleet's decisions those a single gateway would make.

// limitsLib is the window code shared by the scripts: now, the current
// slot, and advance.
const limitsLib = `
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function advance(win, cur, slots)
  local m = redis.call('HMGET', win, 'o', 'n')
  local o, n = tonumber(m[1]), tonumber(m[2])
  if not o or not n then return end
  local cut = cur - slots
  if n <= cut then
    redis.call('DEL', win)
    return
  end
  if o > cut then return end
  local f = {}
  for s = o, cut do
    f[#f + 1] = 'r' .. s
    f[#f + 1] = 't' .. s
  end
  local v = redis.call('HMGET', win, unpack(f))
  local r, tk = 0, 0
  for i = 1, #v, 2 do
    r = r + (tonumber(v[i]) or 0)
    tk = tk + (tonumber(v[i + 1]) or 0)
  end
  redis.call('HDEL', win, unpack(f))
  if r ~= 0 then redis.call('HINCRBY', win, 'R', -r) end
  if tk ~= 0 then redis.call('HINCRBY', win, 'T', -tk) end
  redis.call('HSET', win, 'o', cut + 1)
end
`

// reserveScript admits one request against a tenant's limits, in the
// order max_concurrent, rpm, tpm, and when all pass takes a lease, counts
// the request and reserves its tokens, and records the hold; a refusal
// writes nothing but the purge of expired leases and forgotten slots.
//
// KEYS: win, leases, hold, done. ARGV: request id, max_concurrent, rpm,
// tpm, prompt, need, explicit (1/0), lease ttl ms, slot ms, slots, hold
// ttl ms. Reply: {code, retry ms, reserved, left, requests, tokens, reset
// requests ms, reset tokens ms}; code 0 admitted, 1 max_concurrent, 2 rpm,
// 3 tpm, 4 larger than the whole tpm, 5 the id is settled already.
var reserveScript = redis.NewScript(limitsLib + `
local win, leases = KEYS[1], KEYS[2]
local id = ARGV[1]
local maxc, rpm, tpm = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local prompt, need, explicit = tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7] == '1'
local ttl, slotMs, slots, holdTTL = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])
if redis.call('EXISTS', KEYS[4]) == 1 then return {5, 0, 0, 0, 0, 0, 0, 0} end
local cur = math.floor(now / slotMs)
advance(win, cur, slots)
local m = redis.call('HMGET', win, 'R', 'T', 'nr', 'nt')
local R, T = tonumber(m[1]) or 0, tonumber(m[2]) or 0
local nr, nt = tonumber(m[3]), tonumber(m[4])

-- until returns the ms until the count of field p (total now) is at
-- most target, as slots leave the window oldest first.
local function untilAt(p, total, target)
  if total <= target then return 0 end
  local f = {}
  for s = cur - slots + 1, cur do f[#f + 1] = p .. s end
  local v = redis.call('HMGET', win, unpack(f))
  local n = total
  for i = 1, #v do
    n = n - (tonumber(v[i]) or 0)
    if n <= target then return math.max((cur + i) * slotMs - now, 1) end
  end
  return math.max((cur + slots) * slotMs - now, 1)
end

local code, retry, res, left = 0, 0, 0, 0
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  if redis.call('ZCARD', leases) >= maxc then code, retry = 1, 1000 end
end
if code == 0 and rpm > 0 and R + 1 > rpm then
  code, retry = 2, untilAt('r', R, rpm - 1)
end
if code == 0 and tpm > 0 then
  left = tpm - T
  if (explicit and need > tpm) or (not explicit and prompt > tpm) then
    code = 4
  elseif explicit and need > left then
    code, retry = 3, untilAt('t', T, tpm - need)
  elseif not explicit and left < math.max(prompt, 1) then
    code, retry = 3, untilAt('t', T, tpm - math.max(prompt, 1))
  else
    res = math.min(need, left)
  end
end
if code == 0 then
  redis.call('HINCRBY', win, 'r' .. cur, 1)
  R = redis.call('HINCRBY', win, 'R', 1)
  nr = cur
  if res > 0 then
    redis.call('HINCRBY', win, 't' .. cur, res)
    T = redis.call('HINCRBY', win, 'T', res)
    nt = cur
    redis.call('HSET', win, 'nt', cur)
  end
  redis.call('HSET', win, 'nr', cur, 'n', cur)
  redis.call('HSETNX', win, 'o', cur)
  redis.call('PEXPIRE', win, (slots + 1) * slotMs)
  if maxc > 0 then
    redis.call('ZADD', leases, now + ttl, id)
    redis.call('PEXPIRE', leases, ttl)
  end
  redis.call('SET', KEYS[3], cur .. ' ' .. res, 'PX', holdTTL)
end
local resetR, resetT = 0, 0
if R > 0 and nr then resetR = math.max((nr + slots) * slotMs - now, 0) end
if T > 0 and nt then resetT = math.max((nt + slots) * slotMs - now, 0) end
return {code, retry, res, left, R, T, resetR, resetT}
`)

// settleScript settles (or cancels) one request exactly once: the done
// mark is set if absent, or nothing happens (a replay). It frees the
// lease, takes the reservation back from the slot it was counted in (if
// still in the window: the hold says which and how much), and counts the
// used tokens now; a cancellation takes the request back too and counts
// nothing. A request whose hold is gone (its reserve never ran, or ran so
// long ago that its slot has left the window) has nothing to take back.
//
// KEYS: win, leases, hold, done. ARGV: request id, used, cancel (1/0),
// slot ms, slots, done ttl ms. Reply: 1 applied, 0 a replay.
var settleScript = redis.NewScript(limitsLib + `
local win = KEYS[1]
local slotMs, slots = tonumber(ARGV[4]), tonumber(ARGV[5])
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[6]) then return 0 end
local cur = math.floor(now / slotMs)
local cancel = ARGV[3] == '1'
advance(win, cur, slots)
redis.call('ZREM', KEYS[2], ARGV[1])
local h = redis.call('GET', KEYS[3])
if h then
  redis.call('DEL', KEYS[3])
  local sp = string.find(h, ' ')
  local ep, res = tonumber(string.sub(h, 1, sp - 1)), tonumber(string.sub(h, sp + 1))
  if ep > cur - slots then
    local v = redis.call('HMGET', win, 'r' .. ep, 't' .. ep)
    local r, tk = 0, math.min(res, tonumber(v[2]) or 0)
    if cancel then r = math.min(1, tonumber(v[1]) or 0) end
    if r > 0 then
      redis.call('HINCRBY', win, 'r' .. ep, -r)
      redis.call('HINCRBY', win, 'R', -r)
    end
    if tk > 0 then
      redis.call('HINCRBY', win, 't' .. ep, -tk)
      redis.call('HINCRBY', win, 'T', -tk)
    end
  end
end
local used = tonumber(ARGV[2])
if not cancel and used > 0 then
  redis.call('HINCRBY', win, 't' .. cur, used)
  redis.call('HINCRBY', win, 'T', used)
  redis.call('HSET', win, 'nt', cur, 'n', cur)
  redis.call('HSETNX', win, 'o', cur)
  redis.call('PEXPIRE', win, (slots + 1) * slotMs)
end
return 1
`)

// renewScript renews one tenant's leases held by this instance: expired
// leases are purged first and the others updated only (ZADD XX), so a
// renewal never brings back a lease that has expired.
//
// KEYS: leases. ARGV: lease ttl ms, lease ids... Reply: the ids that were
// gone (expired, or lost with Redis's data).
var renewScript = redis.NewScript(`
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lost = {}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + ttl, ARGV[i])
  else
    lost[#lost + 1] = ARGV[i]
  end
end
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('PEXPIRE', KEYS[1], ttl) end
return lost
`)

// resizeScript changes a live request's token reservation in place (the
// degradation ladder clamped its max_tokens for a fallback model): the
// difference is added to the slot it was counted in, or, once that slot has
// left the window, the new reservation is counted in the current one; the
// hold records the new amount, so that settlement takes back what is
// reserved now. Growing past tpm changes nothing.
//
// KEYS: win, hold, done. ARGV: tpm, reserved, slot ms, slots. Reply: 1
// resized, 0 nothing to resize (settled, or no hold), -1 refused (tpm).
var resizeScript = redis.NewScript(limitsLib + `
local win = KEYS[1]
local tpm, want = tonumber(ARGV[1]), tonumber(ARGV[2])
local slotMs, slots = tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', KEYS[3]) == 1 then return 0 end
local h = redis.call('GET', KEYS[2])
if not h then return 0 end
local sp = string.find(h, ' ')
local ep, res = tonumber(string.sub(h, 1, sp - 1)), tonumber(string.sub(h, sp + 1))
local cur = math.floor(now / slotMs)
advance(win, cur, slots)
local T = tonumber(redis.call('HGET', win, 'T')) or 0
local inWin = ep > cur - slots
local delta = want - res
if not inWin then delta = want end
if delta > 0 and tpm > 0 and T + delta > tpm then return -1 end
if inWin then
  if delta ~= 0 then
    redis.call('HINCRBY', win, 't' .. ep, delta)
    redis.call('HINCRBY', win, 'T', delta)
  end
else
  ep = cur
  if want > 0 then
    redis.call('HINCRBY', win, 't' .. cur, want)
    redis.call('HINCRBY', win, 'T', want)
    redis.call('HSET', win, 'nt', cur, 'n', cur)
    redis.call('HSETNX', win, 'o', cur)
    redis.call('PEXPIRE', win, (slots + 1) * slotMs)
  end
end
redis.call('SET', KEYS[2], ep .. ' ' .. want, 'KEEPTTL')
return 1
`)
