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
    B..'load'        HASH  '<engine>:<rank>|n|q|d|c|a' -> sum over live replicas (a:
                           the queued prefill's attention pairs, `prefill_pairs`)
    B..'bk:'..r      HASH  request id -> '<engine>:<rank>|<prefill>|<context>|<0|1>':
                           replica r's bookings, which are also its share of the sum
    B..'sess:'..s    STRING session -> '<engine>:<rank>', PX
    B..'spc:'..k     STRING '<writer>=<tail>|<engine>:<rank>=<deadline ms>,...': the
                           engines computing the prefix k, in the order they were first
                           placed on it (`Computing.rank`), and the tail (`Anchor.tail`)
                           of a request on `writer`, the first of them still computing
                           it when the tail was written; PX = the latest booking's
    B..'pins'        HASH  prefix key (hex) -> owner tenant
    B..'pinx'        ZSET  prefix key (hex) -> deadline (ms)
    B..'draining'    HASH  '<engine>:<rank>' -> '1'
    B..'engines'     HASH  engine id -> JSON spec (engines added through the admin API)
    B..'cfgver'      STRING counter, bumped by every change of engines, draining, pins
    B..'meta'        HASH  epoch, secret_fp, secret_prev, secret_prev_until

A keyspace call from a script has a fixed cost in Redis on top of the command's, and
their number must not grow with a batch's size, so the scripts batch: the changes to
`load` are summed per field in Lua and written with one HMGET and one HSET (HDEL for the
fields back at 0) per script, a batch of request ends reads and writes its booking
records with one call each, and the anchors of a booking are one MGET. A replica's
share is its booking records (`bk:`), summed when it is reaped: a booking writes no
per-replica copy of the sum.
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
local BK = B .. 'bk:' .. replica

-- a command with many arguments, in pieces (Lua's unpack has a stack limit)
local function many(cmd, key, xs)
  for i = 1, #xs, 4000 do
    redis.call(cmd, key, unpack(xs, i, math.min(i + 3999, #xs)))
  end
end

-- the changes to `load` this script makes, per field, written once (`flush_load`);
-- `known`: the fields' values read by this script, before its changes
local delta, dorder, known = {}, {}, {}
local function add(field, x)
  if x ~= 0 then
    local d = delta[field]
    if d == nil then
      dorder[#dorder + 1] = field
      delta[field] = x
    else
      delta[field] = d + x
    end
  end
end

-- a field's value now: read, plus this script's changes so far
local function value(field)
  return (known[field] or 0) + (delta[field] or 0)
end

local function read_load(fields)
  if #fields == 0 then return end
  local vals = redis.call('HMGET', LOAD, unpack(fields))
  for i = 1, #fields do known[fields[i]] = tonumber(vals[i]) or 0 end
end

local function flush_load()
  local missing = {}
  for _, f in ipairs(dorder) do
    if known[f] == nil and delta[f] ~= 0 then missing[#missing + 1] = f end
  end
  read_load(missing)
  local sets, dels = {}, {}
  for _, f in ipairs(dorder) do
    local d = delta[f]
    if d ~= 0 then
      local v = known[f] + d
      known[f] = v
      if v == 0 then
        dels[#dels + 1] = f
      else
        sets[#sets + 1] = f
        -- every field is an integer; Lua's own number format keeps 14 digits
        sets[#sets + 1] = string.format('%.0f', v)
      end
    end
  end
  if #sets > 0 then many('HSET', LOAD, sets) end
  if #dels > 0 then many('HDEL', LOAD, dels) end
  delta, dorder = {}, {}
end

-- the attention pairs of a prefill of q tokens of a prompt of c (`booked_pairs`, the
-- same operations in the same order: an integer, exact in a double)
local function attn(q, c)
  return q * (math.max(c - q, 0) + (q + 1) / 2)
end

-- a booked request's load, added (sign 1) or taken away (sign -1)
local function apply(e, q, c, p, sign)
  add(e .. '|n', sign)
  if p == '1' then
    add(e .. '|d', sign)
    add(e .. '|c', sign * c)
  else
    add(e .. '|q', sign * q)
    add(e .. '|a', sign * attn(q, c))
  end
end

local function parse(rec)
  local e, q, c, p = string.match(rec, '^([^|]*)|([^|]*)|([^|]*)|([^|]*)$')
  return e, tonumber(q), tonumber(c), p
end

-- take a replica's whole share out of the sum and forget its bookings
local function drop_share(r)
  local bk = B .. 'bk:' .. r
  local kv = redis.call('HGETALL', bk)
  for i = 2, #kv, 2 do
    local e, q, c, p = parse(kv[i])
    apply(e, q, c, p, -1)
  end
  redis.call('DEL', bk)
end

-- the leading block fingerprints two anchor tails share (`types.TAIL_FP_CHARS` = 4
-- hex characters each): a binary search over prefixes, O(log) string compares
local function common(a, b)
  local n = math.floor(math.min(#a, #b) / 4)
  if n == 0 or string.sub(a, 1, 4 * n) == string.sub(b, 1, 4 * n) then return n end
  local lo, hi = 0, n  -- lo fingerprints equal, hi not
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if string.sub(a, 1, 4 * mid) == string.sub(b, 1, 4 * mid) then lo = mid else hi = mid end
  end
  return lo
end

-- an anchor's entry: its tail's writer (nil: none), the tail, and the members' text
local function spec_parts(v)
  local w, t, rest = string.match(v, '^([^=|]*)=([^|]*)|(.*)$')
  if w == nil or w == '' then return nil, '', rest or '' end
  return w, t, rest
end

local reaped = 0
do
  local dead = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 64)
  if #dead > 0 then
    for _, r in ipairs(dead) do drop_share(r) end
    flush_load()
    redis.call('ZREM', LEASES, unpack(dead))
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

-- this replica's lease moved on if it still has one (one call, usually): a lease
-- already reaped is gone, so XX finds nothing to move; not moved (CH = 0) is also a
-- lease already this far on (the same ms), which `live` tells apart
local function renewed()
  if redis.call('ZADD', LEASES, 'XX', 'GT', 'CH', now + ttl, replica) == 1 then return true end
  return live()
end

-- this replica's booking records as this script changes them: request id -> record,
-- or false (released); written once (`flush_bk`)
local records = {}
local function flush_bk()
  local sets, dels = {}, {}
  for rid, rec in pairs(records) do
    if rec then
      sets[#sets + 1] = rid
      sets[#sets + 1] = rec
    else
      dels[#dels + 1] = rid
    end
  end
  if #sets > 0 then many('HSET', BK, sets) end
  if #dels > 0 then many('HDEL', BK, dels) end
  records = {}
end

-- The ends of this replica's requests, batched: ARGV[from..to] are 'r'..request id (the
-- request ended: its load leaves) or 'p'..request id (its prefill is done: its queued
-- tokens turn into a decode), applied in order. One character per op in the result:
-- 'o' applied, 'n' no such booking here (already released, or booked while this
-- replica could not reach Redis and not resynchronised yet), '-' already prefilled.
-- The booking record makes each op idempotent: a release deletes it. `also`: one more
-- request id whose record is read with the batch's (the booking's duplicate check);
-- the second result is that record, or false.
local function settle(from, to, also)
  local rids = {}
  for i = from, to do rids[#rids + 1] = string.sub(ARGV[i], 2) end
  if also then rids[#rids + 1] = also end
  if #rids == 0 then return '', false end
  local recs = redis.call('HMGET', BK, unpack(rids))
  local codes = {}
  for i = from, to do
    local rid = rids[i - from + 1]
    local rec = records[rid]
    if rec == nil then rec = recs[i - from + 1] end
    if not rec then
      codes[#codes + 1] = 'n'
    else
      local e, q, c, p = parse(rec)
      if string.sub(ARGV[i], 1, 1) == 'r' then
        apply(e, q, c, p, -1)
        records[rid] = false
        codes[#codes + 1] = 'o'
      elseif p == '1' then
        codes[#codes + 1] = '-'
      else
        add(e .. '|q', -q)
        add(e .. '|a', -attn(q, c))
        add(e .. '|d', 1)
        add(e .. '|c', c)
        records[rid] = e .. '|' .. q .. '|' .. c .. '|1'
        codes[#codes + 1] = 'o'
      end
    end
  end
  return table.concat(codes), also and recs[#recs]
end
"""

# ARGV[5] request id, [6] prefill, [7] context, [8..10] the load weights (in flight,
# queued tokens, decodes), [11] session (a key name suffix, or ''), [12] session TTL
# ms, [13] placement TTL ms, [14] prompt tokens, [15] block size (0 and 0: book
# `prefill`), [16] outside ceiling ('' = no candidate outside the shortlist), [17]
# outside credit, [18] n: the shortlist's length, [19] m: the anchors', [20] k: the
# queued request ends'; then the shortlist in the router's order, 4 per candidate
# (engine, ceiling, credit, held blocks or ''; `Candidate`: with the prompt and block
# size, the chosen engine is booked with the prompt beyond what it holds or computes,
# else with `prefill`), the anchors, 3 each (key, blocks, tail), and the request ends queued
# since this replica's last call (`settle`), applied first: they ride on the booking
# instead of a round trip of their own.
# With the outside terms (`OutsideTerms`), the session's bound engine and the engines
# computing a part of the request's prefix are candidates too when the shortlist does
# not list them (`choose.outsiders`: after the shortlist, the bound engine first, then
# by engine and rank; not a draining one), for the session and pending steps only.
# Returns {'lost'} | {'dup', engine, settle codes}
#       | {'ok', index (1-based; 0: an engine outside the shortlist), reason,
#          settle codes, booked prefill, engine, n1, q1, d1, c1, a1, ...} (the shortlist's)
BOOK = (
    PRELUDE
    + r"""
if not renewed() then return {'lost'} end
local rid = ARGV[5]
local n, m = tonumber(ARGV[18]), tonumber(ARGV[19])
local at = 21 + 4 * n + 3 * m  -- the first request end
local settled, prev = settle(at, at + tonumber(ARGV[20]) - 1, rid)
if prev then
  flush_load()
  flush_bk()
  return {'dup', parse(prev), settled}
end
local q, c = tonumber(ARGV[6]), tonumber(ARGV[7])
local wn, wq, wd = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local sess, sess_ttl, spec_ttl = ARGV[11], ARGV[12], tonumber(ARGV[13])
local prompt, bsz = tonumber(ARGV[14]), tonumber(ARGV[15])
local oceil = tonumber(ARGV[16])  -- nil: no candidate outside the shortlist
local ocredit = tonumber(ARGV[17]) or 0
local engs, ceils, credits, helds, fields = {}, {}, {}, {}, {}
for i = 1, n do
  local a = 17 + 4 * i
  local e = ARGV[a]
  engs[i] = e
  ceils[i] = tonumber(ARGV[a + 1])
  credits[i] = tonumber(ARGV[a + 2]) or 0
  helds[i] = tonumber(ARGV[a + 3])
  fields[5 * i - 4] = e .. '|n'
  fields[5 * i - 3] = e .. '|q'
  fields[5 * i - 2] = e .. '|d'
  fields[5 * i - 1] = e .. '|c'
  fields[5 * i] = e .. '|a'
end
-- the fields the request ends change, read with the shortlist's
local reads = {}
for i = 1, 5 * n do reads[i] = fields[i] end
for _, f in ipairs(dorder) do reads[#reads + 1] = f end
read_load(reads)
local akeys, ablocks, atails = {}, {}, {}
local whole = 0  -- the request's blocks: its longest anchor
for j = 1, m do
  local a = 18 + 4 * n + 3 * j
  akeys[j] = B .. 'spc:' .. ARGV[a]
  ablocks[j] = tonumber(ARGV[a + 1])
  atails[j] = ARGV[a + 2]
  if ablocks[j] > whole then whole = ablocks[j] end
end
local pre, score, under = {}, {}, {}
local function weigh(i, fn, fq, fd)
  local ln, lq, ld = value(fn), value(fq), value(fd)
  score[i] = wn * ln + wq * lq + wd * ld
  under[i] = score[i] < ceils[i]
end
for i = 1, n do
  for x = 5 * i - 4, 5 * i do pre[x] = value(fields[x]) end
  weigh(i, fields[5 * i - 4], fields[5 * i - 3], fields[5 * i - 2])
end
local pos = {}
for i = 1, n do pos[engs[i]] = i end
-- per candidate, the longest prefix of the request being computed there (an anchor's
-- depth; on the anchor's tail writer, as far past it as the tails match) and its rank
-- among that anchor's live members (the order they were first placed in); per engine
-- outside the shortlist, the same; per anchor, its live members in that order and its
-- tail's writer (while that writer still computes it) and tail
local blocks, ranks, pend, prank, members, orders = {}, {}, {}, {}, {}, {}
local writers, wtails = {}, {}
local function deeper(b, r, b0, r0)
  return b > (b0 or 0) or (b == b0 and r < r0)
end
if m > 0 then
  local specs = redis.call('MGET', unpack(akeys))
  for j = 1, m do
    local live_j, order_j = {}, {}
    members[j], orders[j] = live_j, order_j
    if specs[j] then
      local w, t, rest = spec_parts(specs[j])
      for e, d in string.gmatch(rest, '([^,=]+)=([^,]+)') do
        d = tonumber(d)
        if d > now and not live_j[e] then
          local r = #order_j
          live_j[e] = d
          order_j[r + 1] = e
          local b = ablocks[j]
          if e == w then
            writers[j], wtails[j] = w, t
            b = b + common(t, atails[j])
          end
          local i = pos[e]
          if i then
            if deeper(b, r, blocks[i], ranks[i]) then blocks[i], ranks[i] = b, r end
          elseif deeper(b, r, pend[e], prank[e]) then
            pend[e], prank[e] = b, r
          end
        end
      end
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
    blocks[total], ranks[total] = pend[e], prank[e]
    local fn, fq, fd = e .. '|n', e .. '|q', e .. '|d'
    read_load({fn, fq, fd, e .. '|c'})
    weigh(total, fn, fq, fd)
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
  -- under its ceiling raised by its credit for the part being computed there; the
  -- deepest being computed, then the first placed there, then the candidates' order
  local best, brank = 0, 0
  for i = 1, total do
    local b, r = blocks[i] or 0, ranks[i] or 0
    if b > 0 and deeper(b, r, best, brank)
        and score[i] < ceils[i] + credits[i] * math.min(b / whole, 1) then
      chosen, reason, best, brank = i, 'pending', b, r
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
apply(e, q, c, '0', 1)
flush_load()
records[rid] = e .. '|' .. q .. '|' .. c .. '|0'
flush_bk()
if sess ~= '' then redis.call('SET', B .. 'sess:' .. sess, e, 'PX', sess_ttl) end
if m > 0 then
  -- per anchor, its live members in the order they were first placed, with this
  -- engine's deadline moved on (never back) or this engine last; the key's TTL is the
  -- latest booking's
  -- latest booking's; the tail stays its writer's while the writer computes it, else
  -- it becomes this request's. An anchor this engine computes with more than 3/4 of
  -- the TTL left and a live writer is not written again: under a burst on one prefix
  -- most bookings write no anchor (a placement lasts 3/4 to all of the TTL after the
  -- latest booking)
  local until_ms = now + spec_ttl
  local fresh_ms = until_ms - math.floor(spec_ttl / 4)
  for j = 1, m do
    local live_j, order_j = members[j], orders[j]
    local w, t = writers[j], wtails[j]
    if not (w and live_j[e] and live_j[e] >= fresh_ms) then
      if not w then w, t = e, atails[j] end
      if not live_j[e] then order_j[#order_j + 1] = e end
      if (live_j[e] or 0) < until_ms then live_j[e] = until_ms end
      local parts = {}
      for k, x in ipairs(order_j) do parts[k] = x .. '=' .. string.format('%d', live_j[x]) end
      local v = w .. '=' .. t .. '|' .. table.concat(parts, ',')
      redis.call('SET', akeys[j], v, 'PX', spec_ttl)
    end
  end
end
local out = {'ok', chosen <= n and chosen or 0, reason, settled, q, e}
for i = 1, 5 * n do out[#out + 1] = pre[i] end
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
  apply(e, q, c, p, 1)
  records[rid] = e .. '|' .. q .. '|' .. c .. '|' .. p
  count = count + 1
end
flush_load()
flush_bk()
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
if not renewed() then return {'lost'} end
local settled = settle(5, #ARGV)
flush_load()
flush_bk()
return {'ok', reaped, settled}
"""
)

# A replica leaving cleanly: its share goes now, not at the lease's end.
LEAVE = (
    PRELUDE
    + r"""
drop_share(replica)
flush_load()
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

# ARGV[5..] the anchors, 2 each (key suffix, tail). Returns {j, engine, blocks, ...}:
# anchor j (1-based) is being computed on engine, to `blocks` past the anchor's start
# (the anchor's depth is the caller's: `blocks` here is how far past it the tails
# match on the tail's writer, 0 on the others); an anchor's engines in the order they
# were first placed on it.
PENDING = (
    PRELUDE
    + r"""
local out = {}
if #ARGV < 5 then return out end
local keys, tails = {}, {}
for j = 5, #ARGV, 2 do
  keys[#keys + 1] = B .. 'spc:' .. ARGV[j]
  tails[#tails + 1] = ARGV[j + 1]
end
local specs = redis.call('MGET', unpack(keys))
for j = 1, #keys do
  if specs[j] then
    local w, t, rest = spec_parts(specs[j])
    for e, d in string.gmatch(rest, '([^,=]+)=([^,]+)') do
      if tonumber(d) > now then
        local past = 0
        if e == w then past = common(t, tails[j]) end
        out[#out + 1] = j; out[#out + 1] = e; out[#out + 1] = past
      end
    end
  end
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
for _, k in ipairs(expired) do
  redis.call('HDEL', PINS, k)
  redis.call('HDEL', B .. 'pinkeys', k)
  redis.call('HDEL', B .. 'pinrec', k)
end
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

# ARGV[5..] prefix keys (hex). Returns each one's milliseconds left, -1 for one that is
# not pinned (or has expired).
PIN_TTLS = (
    PRELUDE
    + r"""
local PINX = B .. 'pinx'
local out = {}
for i = 5, #ARGV do
  local at = redis.call('ZSCORE', PINX, ARGV[i])
  if at and tonumber(at) > now then out[#out + 1] = tonumber(at) - now else out[#out + 1] = -1 end
end
return out
"""
)

# Returns {cfgver, #engines*2, engines kv..., #draining*2, draining kv..., pins kv...}
CONFIG = (
    PRELUDE
    + r"""
local PINS, PINX = B .. 'pins', B .. 'pinx'
local expired = redis.call('ZRANGEBYSCORE', PINX, '-inf', now)
for _, k in ipairs(expired) do
  redis.call('HDEL', PINS, k)
  redis.call('HDEL', B .. 'pinkeys', k)
  redis.call('HDEL', B .. 'pinrec', k)
end
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
