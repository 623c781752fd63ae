"""The server-side Lua scripts of the shared fleet state (Redis 7.0 commands only).

Every script starts with `PRELUDE`, whose ARGV[1..4] are the key base (the fleet's
hash-tagged prefix, e.g. "{quillcache}:"), the calling replica, its lease TTL (ms),
and "now" in ms ("" = Redis's own clock, `TIME`; tests pass their own). The prelude
reaps dead replicas (lease deadline <= now) before anything else: their share is
subtracted from the aggregate and their keys deleted, so a dead replica's load goes
away without the dead replica.

All the keys of one fleet carry the same hash tag, so they live in one slot; the
scripts build the per-replica and per-anchor key names themselves from the base, which
a standalone Redis (and Valkey) allows.

Layout under the base B:
    B..'leases'      ZSET  replica -> lease deadline (ms)
    B..'load'        HASH  '<engine>:<rank>|n|q|d|c' -> sum over live replicas
    B..'share:'..r   HASH  the same fields, replica r's part of the sum
    B..'bk:'..r      HASH  request id -> '<engine>:<rank>|<prefill>|<context>|<0|1>'
    B..'sess:'..s    STRING session -> '<engine>:<rank>', PX
    B..'spec:'..k    ZSET  '<engine>:<rank>' -> deadline (ms); PX = the latest booking's
    B..'pins'        HASH  prefix key (hex) -> owner tenant
    B..'pinx'        ZSET  prefix key (hex) -> deadline (ms)
    B..'draining'    HASH  '<engine>:<rank>' -> '1'
    B..'engines'     HASH  engine id -> JSON spec (engines added through the admin API)
    B..'cfgver'      STRING counter, bumped by every change of engines, draining, pins
    B..'meta'        HASH  epoch, secret_fp, secret_prev, secret_prev_until
"""

from __future__ import annotations

PRELUDE = r"""
local B = ARGV[1]
local replica = ARGV[2]
local ttl = tonumber(ARGV[3])
local now
if ARGV[4] ~= '' then
  now = tonumber(ARGV[4])
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local LEASES = B .. 'leases'
local LOAD = B .. 'load'
local SHARE = B .. 'share:' .. replica
local BK = B .. 'bk:' .. replica

local function bump(key, field, delta)
  if delta ~= 0 then
    if redis.call('HINCRBY', key, field, delta) == 0 then redis.call('HDEL', key, field) end
  end
end

-- a booked request's load, added (sign 1) or taken away (sign -1), to the sum and a share
local function apply(share, e, q, c, p, sign)
  bump(LOAD, e .. '|n', sign); bump(share, e .. '|n', sign)
  if p == '1' then
    bump(LOAD, e .. '|d', sign); bump(share, e .. '|d', sign)
    bump(LOAD, e .. '|c', sign * c); bump(share, e .. '|c', sign * c)
  else
    bump(LOAD, e .. '|q', sign * q); bump(share, e .. '|q', sign * q)
  end
end

local function parse(rec)
  local e, q, c, p = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  return e, tonumber(q), tonumber(c), p
end

-- take a replica's whole share out of the sum and forget its bookings
local function drop_share(r)
  local sk = B .. 'share:' .. r
  local kv = redis.call('HGETALL', sk)
  for i = 1, #kv, 2 do bump(LOAD, kv[i], -tonumber(kv[i + 1])) end
  redis.call('DEL', sk, B .. 'bk:' .. r)
end

local reaped = 0
do
  local dead = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 64)
  for _, r in ipairs(dead) do
    drop_share(r)
    redis.call('ZREM', LEASES, r)
  end
  reaped = #dead
end

local function live()
  local d = redis.call('ZSCORE', LEASES, replica)
  return d and tonumber(d) > now
end

local function renew()
  redis.call('ZADD', LEASES, now + ttl, replica)
end

-- The ends of this replica's requests, batched: ARGV[from..] are 'r'..request id (the
-- request ended: its load leaves) or 'p'..request id (its prefill is done: its queued
-- tokens turn into a decode), applied in order. One character per op in the result:
-- 'o' applied, 'n' no such booking here (already released, or booked while this
-- replica could not reach Redis and not resynchronised yet), '-' already prefilled.
-- The booking record makes each op idempotent: a release deletes it.
local function settle(from)
  local codes = {}
  for i = from, #ARGV do
    local a = ARGV[i]
    local rid = string.sub(a, 2)
    local rec = redis.call('HGET', BK, rid)
    if not rec then
      codes[#codes + 1] = 'n'
    else
      local e, q, c, p = parse(rec)
      if string.sub(a, 1, 1) == 'r' then
        apply(SHARE, e, q, c, p, -1)
        redis.call('HDEL', BK, rid)
        codes[#codes + 1] = 'o'
      elseif p == '1' then
        codes[#codes + 1] = '-'
      else
        bump(LOAD, e .. '|q', -q); bump(SHARE, e .. '|q', -q)
        bump(LOAD, e .. '|d', 1); bump(SHARE, e .. '|d', 1)
        bump(LOAD, e .. '|c', c); bump(SHARE, e .. '|c', c)
        redis.call('HSET', BK, rid, e .. '|' .. q .. '|' .. c .. '|1')
        codes[#codes + 1] = 'o'
      end
    end
  end
  return table.concat(codes)
end
"""

# ARGV[5] request id, [6] 'prefill|context|wn|wq|wd|session|session ttl ms|spec ttl ms
# [|prompt|block size[|outside ceiling|outside credit]]' (session: a key name suffix or
# empty), [7] the shortlist 'engine=ceiling[~credit[~held blocks]],...' in the router's
# order (`Candidate.credit` and `cached_blocks`; with the prompt and block size, the
# chosen engine is booked with the prompt beyond what it holds or computes, else with
# `prefill`), [8] the request's anchors 'key=blocks,...' (may be empty), [9..] this
# replica's request ends queued since its last call (`settle`), applied first: they
# ride on the booking instead of a round trip of their own. Few arguments for the
# booking itself: redis-py packs each argument in Python, and these string.gmatch loops
# cost less here than a long ARGV costs there.
# With the outside terms (`OutsideTerms`), the session's bound engine and the engines
# computing a part of the request's prefix are candidates too when the shortlist does
# not list them (`choose.outsiders`: after the shortlist, the bound engine first, then
# by engine and rank; not a draining one), for the session and pending steps only.
# Returns {'lost'} | {'dup', engine, settle codes}
#       | {'ok', index (1-based; 0: an engine outside the shortlist), reason,
#          settle codes, booked prefill, engine, n1, q1, d1, c1, ...} (the shortlist's)
BOOK = (
    PRELUDE
    + r"""
if not live() then return {'lost'} end
renew()
local settled = settle(9)
local rid = ARGV[5]
local prev = redis.call('HGET', BK, rid)
if prev then
  local e = parse(prev)
  return {'dup', e, settled}
end
local f = {}
for x in string.gmatch(ARGV[6] .. '|', '([^|]*)|') do f[#f + 1] = x end
local q, c, wn, wq, wd = tonumber(f[1]), tonumber(f[2]), tonumber(f[3]), tonumber(f[4]),
  tonumber(f[5])
local sess, sess_ttl, spec_ttl = f[6], tonumber(f[7]), tonumber(f[8])
local prompt = f[9] and tonumber(f[9]) or 0
local bsz = f[10] and tonumber(f[10]) or 0
local oceil = f[11] and tonumber(f[11])  -- nil: no candidate outside the shortlist
local ocredit = f[12] and tonumber(f[12]) or 0
local engs, ceils, credits, helds, fields = {}, {}, {}, {}, {}
local n = 0
for e, rest in string.gmatch(ARGV[7], '([^=,]+)=([^,]+)') do
  local ceil, credit, held = string.match(rest, '^([^~]*)~?([^~]*)~?([^~]*)$')
  n = n + 1
  engs[n] = e
  ceils[n] = tonumber(ceil)
  credits[n] = tonumber(credit) or 0
  helds[n] = tonumber(held)
  fields[#fields + 1] = e .. '|n'
  fields[#fields + 1] = e .. '|q'
  fields[#fields + 1] = e .. '|d'
  fields[#fields + 1] = e .. '|c'
end
local akeys, ablocks = {}, {}
local whole = 0  -- the request's blocks: its longest anchor
for k, b in string.gmatch(ARGV[8], '([^=,]+)=([^,]+)') do
  akeys[#akeys + 1] = k
  ablocks[#ablocks + 1] = tonumber(b)
  if ablocks[#ablocks] > whole then whole = ablocks[#ablocks] end
end
local m = #akeys
local vals = redis.call('HMGET', LOAD, unpack(fields))
local score, under = {}, {}
local function weigh(i, ln, lq, ld)
  score[i] = wn * (tonumber(ln) or 0) + wq * (tonumber(lq) or 0) + wd * (tonumber(ld) or 0)
  under[i] = score[i] < ceils[i]
end
for i = 1, n do weigh(i, vals[4 * i - 3], vals[4 * i - 2], vals[4 * i - 1]) end
local pos = {}
for i = 1, n do pos[engs[i]] = i end
-- per candidate, the longest of the request's anchors being computed there; per
-- engine outside the shortlist, the same
local blocks, pend = {}, {}
for j = 1, m do
  local members = redis.call('ZRANGEBYSCORE', B .. 'spec:' .. akeys[j], '(' .. now, '+inf')
  local b = ablocks[j]
  for _, e in ipairs(members) do
    local i = pos[e]
    if i then
      if b > (blocks[i] or 0) then blocks[i] = b end
    elseif b > (pend[e] or 0) then
      pend[e] = b
    end
  end
end
local bound = nil
if sess ~= '' then bound = redis.call('GET', B .. 'sess:' .. sess) end
local total = n
if oceil then
  local DRAINING = B .. 'draining'
  local function outsider(e, ceil, credit)
    total = total + 1
    engs[total], ceils[total], credits[total], helds[total] = e, ceil, credit, 0
    blocks[total] = pend[e]
    local v = redis.call('HMGET', LOAD, e .. '|n', e .. '|q', e .. '|d')
    weigh(total, v[1], v[2], v[3])
  end
  if bound and not pos[bound] and redis.call('HEXISTS', DRAINING, bound) == 0 then
    outsider(bound, oceil + ocredit, 0)  -- taken as holding the session's prefix
  end
  local others, order = {}, {}
  for e in pairs(pend) do
    if e ~= bound and redis.call('HEXISTS', DRAINING, e) == 0 then
      local en, rk = string.match(e, '^([^:]*):(.*)$')
      others[#others + 1] = e
      order[e] = {tonumber(en) or 0, tonumber(rk) or 0}
    end
  end
  table.sort(others, function(x, y)
    local a, b = order[x], order[y]
    if a[1] ~= b[1] then return a[1] < b[1] end
    return a[2] < b[2]
  end)
  for _, e in ipairs(others) do outsider(e, oceil, ocredit) end
end
local chosen, reason = nil, nil
if bound then
  for i = 1, total do
    if engs[i] == bound and under[i] then chosen, reason = i, 'session'; break end
  end
end
if not chosen and m > 0 then
  -- under its ceiling raised by its credit for the part being computed there
  local best = 0
  for i = 1, total do
    local b = blocks[i] or 0
    if b > best and score[i] < ceils[i] + credits[i] * math.min(b / whole, 1) then
      chosen, reason, best = i, 'pending', b
    end
  end
end
if not chosen then
  for i = 1, n do
    if under[i] then chosen, reason = i, 'under'; break end
  end
end
if not chosen then
  chosen, reason = 1, 'over'
  for i = 2, n do
    if score[i] - ceils[i] < score[chosen] - ceils[chosen] then chosen = i end
  end
end
local e = engs[chosen]
-- its prefill there: the prompt beyond what the engine holds or is computing of it
-- (when the replica sent the prompt and what the candidate holds), else the replica's
if prompt > 0 and bsz > 0 and helds[chosen] then
  local held = math.max(helds[chosen], blocks[chosen] or 0)
  q = math.max(prompt - held * bsz, 1)
end
apply(SHARE, e, q, c, '0', 1)
redis.call('HSET', BK, rid, e .. '|' .. q .. '|' .. c .. '|0')
if sess ~= '' then redis.call('SET', B .. 'sess:' .. sess, e, 'PX', sess_ttl) end
for j = 1, m do
  -- members are engines (at most the fleet); a lapsed one is skipped by the readers'
  -- score range and goes with the key, whose TTL is the latest booking's
  local k = B .. 'spec:' .. akeys[j]
  redis.call('ZADD', k, 'GT', now + spec_ttl, e)
  redis.call('PEXPIRE', k, spec_ttl)
end
local out = {'ok', chosen <= n and chosen or 0, reason, settled, q, e}
for i = 1, 4 * n do out[#out + 1] = tonumber(vals[i]) or 0 end
return out
"""
)

# Replace this replica's share with its own book (the caller holds its other calls
# back meanwhile). ARGV[5..]: request id, engine, prefill, context, prefilled (0|1),
# repeated. Returns {'ok', bookings}.
RESYNC = (
    PRELUDE
    + r"""
drop_share(replica)
local count = 0
for i = 5, #ARGV, 5 do
  local rid, e, p = ARGV[i], ARGV[i + 1], ARGV[i + 4]
  local q, c = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  apply(SHARE, e, q, c, p, 1)
  redis.call('HSET', BK, rid, e .. '|' .. q .. '|' .. c .. '|' .. p)
  count = count + 1
end
renew()
return {'ok', count}
"""
)

# The lease renewed, and the request ends queued since this replica's last call
# (ARGV[5..], `settle`): the heartbeat and the batched releases and prefills are one
# script. Returns {'lost'} | {'ok', reaped, settle codes}
SETTLE = (
    PRELUDE
    + r"""
if not live() then return {'lost'} end
renew()
local settled = settle(5)
return {'ok', reaped, settled}
"""
)

# A replica leaving cleanly: its share goes now, not at the lease's end.
LEAVE = (
    PRELUDE
    + r"""
drop_share(replica)
redis.call('ZREM', LEASES, replica)
return {'ok'}
"""
)

# The fleet's load (after reaping) and the config version.
# Returns {cfgver, epoch, field1, value1, ...}
SNAPSHOT = (
    PRELUDE
    + r"""
local out = {redis.call('GET', B .. 'cfgver') or '0'}
out[2] = redis.call('HGET', B .. 'meta', 'epoch') or ''
local kv = redis.call('HGETALL', LOAD)
for i = 1, #kv do out[#out + 1] = kv[i] end
return out
"""
)

# ARGV[5..] anchor key suffixes. Returns {j, engine, ...}: anchor j (1-based) is being
# computed on engine.
PENDING = (
    PRELUDE
    + r"""
local out = {}
for j = 5, #ARGV do
  local members = redis.call('ZRANGEBYSCORE', B .. 'spec:' .. ARGV[j], '(' .. now, '+inf')
  for _, e in ipairs(members) do out[#out + 1] = j - 4; out[#out + 1] = e end
end
return out
"""
)

# ARGV[5] prefix key (hex), [6] tenant, [7] TTL ms.
# Returns {'ok'} | {'owned', owner}
PIN = (
    PRELUDE
    + r"""
local PINS, PINX = B .. 'pins', B .. 'pinx'
local expired = redis.call('ZRANGEBYSCORE', PINX, '-inf', now)
for _, k in ipairs(expired) do redis.call('HDEL', PINS, k) end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', PINX, '-inf', now)
  redis.call('INCR', B .. 'cfgver')
end
local owner = redis.call('HGET', PINS, ARGV[5])
if owner and owner ~= ARGV[6] then return {'owned', owner} end
redis.call('HSET', PINS, ARGV[5], ARGV[6])
redis.call('ZADD', PINX, now + tonumber(ARGV[7]), ARGV[5])
if not owner then redis.call('INCR', B .. 'cfgver') end
return {'ok'}
"""
)

# ARGV[5] prefix key (hex), [6] tenant. Returns {'ok'} | {'none'} | {'owned', owner}
UNPIN = (
    PRELUDE
    + r"""
local PINS, PINX = B .. 'pins', B .. 'pinx'
local owner = redis.call('HGET', PINS, ARGV[5])
if not owner then return {'none'} end
if owner ~= ARGV[6] then return {'owned', owner} end
redis.call('HDEL', PINS, ARGV[5])
redis.call('ZREM', PINX, ARGV[5])
redis.call('INCR', B .. 'cfgver')
return {'ok'}
"""
)

# Returns {cfgver, #engines*2, engines kv..., #draining*2, draining kv..., pins kv...}
CONFIG = (
    PRELUDE
    + r"""
local PINS, PINX = B .. 'pins', B .. 'pinx'
local expired = redis.call('ZRANGEBYSCORE', PINX, '-inf', now)
for _, k in ipairs(expired) do redis.call('HDEL', PINS, k) end
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', PINX, '-inf', now)
  redis.call('INCR', B .. 'cfgver')
end
local out = {redis.call('GET', B .. 'cfgver') or '0'}
for _, name in ipairs({'engines', 'draining'}) do
  local kv = redis.call('HGETALL', B .. name)
  out[#out + 1] = #kv
  for i = 1, #kv do out[#out + 1] = kv[i] end
end
local kv = redis.call('HGETALL', PINS)
for i = 1, #kv do out[#out + 1] = kv[i] end
return out
"""
)

# ARGV[5] hash name ('engines' | 'draining'), [6] field, [7] value or '' to delete.
SET_CONFIG = (
    PRELUDE
    + r"""
local h = B .. ARGV[5]
local changed
if ARGV[7] == '' then
  changed = redis.call('HDEL', h, ARGV[6])
else
  changed = 1
  if redis.call('HGET', h, ARGV[6]) == ARGV[7] then changed = 0 end
  redis.call('HSET', h, ARGV[6], ARGV[7])
end
if changed > 0 then redis.call('INCR', B .. 'cfgver') end
return {'ok', changed}
"""
)

# The fleet's secret fingerprint. ARGV[5] this replica's current fingerprint, [6] its
# previous one or '', [7] until when (ms) the previous one is accepted, [8] a new epoch
# (used when the fleet has none yet).
# Returns {'set'|'ok'|'rotated'|'previous'|'mismatch', stored fingerprint, epoch}
SECRET = (
    PRELUDE
    + r"""
local META = B .. 'meta'
redis.call('HSETNX', META, 'epoch', ARGV[8])
local epoch = redis.call('HGET', META, 'epoch')
local cur, prev, until_ms = ARGV[5], ARGV[6], tonumber(ARGV[7])
local stored = redis.call('HGET', META, 'secret_fp')
if not stored then
  redis.call('HSET', META, 'secret_fp', cur)
  return {'set', cur, epoch}
end
if stored == cur then return {'ok', stored, epoch} end
if prev ~= '' and prev == stored and until_ms > now then
  redis.call('HSET', META, 'secret_fp', cur, 'secret_prev', stored, 'secret_prev_until', until_ms)
  return {'rotated', stored, epoch}
end
local sprev = redis.call('HGET', META, 'secret_prev')
local suntil = tonumber(redis.call('HGET', META, 'secret_prev_until') or '0')
if sprev == cur and suntil > now then return {'previous', stored, epoch} end
return {'mismatch', stored, epoch}
"""
)
