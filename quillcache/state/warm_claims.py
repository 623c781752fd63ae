"""Fleet-wide claims and budgets for the policy engine's warm requests, and the fleet's
heat of hot prefixes.

With several gateway replicas each replica's policy engine decides its own prefetches,
retention touches and replicas, so without a shared marker N replicas warm the same
prefix on the same engine N times and each spends its own budget. Before a warm is sent,
`WarmClaims.claim` runs one Lua script (one round trip) that, atomically:

- fails with `in_flight` when the marker `{prefix}:warm:<action>:<engine>:<last key>`
  exists (another replica's warm is in flight, or succeeded less than the lingering
  interval ago);
- fails with `budget` unless both the engine's and the tenant's token buckets
  (`{prefix}:warmbudget:e:<engine>`, `{prefix}:warmbudget:t:<tenant>`) hold the
  warm's tokens, and otherwise takes them from both;
- sets the marker (SET NX PX: the warm's timeout plus a margin, so a replica that dies
  mid-warm frees it) to this object's owner token.

`release` ends the claim, only if this owner still holds it (compare-and-delete): a
successful warm leaves the marker for `linger_s` (the fleet-wide "recently placed"
rule), a failed one deletes it. The buckets refill on Redis's clock (TIME), so the
replicas' clocks need not agree.

Heat (`share_heat`): a load balancer spreads a hot prefix's requests over the replicas,
so each sees about its share of the rate and none would find it hot. Each replica's
policy tick publishes its rates of the anchors it holds copies for (a hash per replica
under `{prefix}:heat:`, with a TTL of a few ticks, listed in `{prefix}:heaters`) and gets
back, in the same script, the number of replicas publishing and each anchor's rate summed
over them; the policy engine then copies at its share of the threshold and replicates
at the fleet's rate (`gateway/policy_loop.py`).

Redis unreachable or slower than `timeout_s`: every call returns `FLEET_DOWN` (the caller
falls back to its own markers and budgets), logged once per outage and counted; Redis is
tried again `retry_s` later. Nothing here raises into a warm or blocks routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError
from redis.retry import Retry

from quillcache.errors import ConfigError

log = logging.getLogger(__name__)

# KEYS: marker, engine bucket, tenant bucket
# ARGV: owner, marker ttl ms, tokens, engine rate/s, engine burst, tenant rate/s, tenant burst
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'in_flight' end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local need = tonumber(ARGV[3])
local function level(key, rate, burst)
  local v = redis.call('HMGET', key, 'l', 'at')
  local l, at = tonumber(v[1]), tonumber(v[2])
  if l == nil or at == nil then return burst end
  return math.min(burst, l + math.max(now - at, 0) * rate / 1000)
end
local function put(key, l, rate, burst)
  redis.call('HSET', key, 'l', string.format('%.17g', l), 'at', now)
  if rate > 0 then
    -- a bucket left alone refills to its burst, which an absent key means too
    redis.call('PEXPIRE', key, math.ceil(burst / rate * 1000) + 1000)
  end
end
local er, eb = tonumber(ARGV[4]), tonumber(ARGV[5])
local tr, tb = tonumber(ARGV[6]), tonumber(ARGV[7])
local el, tl = level(KEYS[2], er, eb), level(KEYS[3], tr, tb)
if need > el or need > tl then return 'budget' end
put(KEYS[2], el - need, er, eb)
put(KEYS[3], tl - need, tr, tb)
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 'ok'
"""

# KEYS: marker; ARGV: owner, linger ms (0: delete)
RELEASE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
if tonumber(ARGV[2]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
else
  redis.call('DEL', KEYS[1])
end
return 1
"""


# KEYS: the zset of replicas sharing heat (-> deadline ms)
# ARGV: this replica's token, TTL ms, the heat hashes' key base, then pairs (anchor, rate)
# Returns {replicas sharing heat, the fleet's rate of each given anchor (as text)...}
HEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local mine = ARGV[3] .. ARGV[1]
redis.call('DEL', mine)
local anchors, fields = {}, {}
for i = 4, #ARGV, 2 do
  anchors[#anchors + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i]
  fields[#fields + 1] = ARGV[i + 1]
end
if #fields > 0 then
  redis.call('HSET', mine, unpack(fields))
  redis.call('PEXPIRE', mine, ttl)
end
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local sums = {}
for j = 1, #anchors do sums[j] = 0 end
if #anchors > 0 then
  for _, m in ipairs(members) do
    local v = redis.call('HMGET', ARGV[3] .. m, unpack(anchors))
    for j = 1, #anchors do sums[j] = sums[j] + (tonumber(v[j]) or 0) end
  end
end
local out = {#members}
for j = 1, #anchors do out[#out + 1] = string.format('%.17g', sums[j]) end
return out
"""

#: The most anchors one call shares (the hottest first): Lua's `unpack` has a stack limit.
MAX_SHARED_ANCHORS = 1024


class ClaimResult(enum.Enum):
    OK = "ok"  # claimed, and the tokens taken from both buckets
    IN_FLIGHT = "in_flight"  # another claim holds the marker
    BUDGET = "budget"  # a bucket lacks the tokens (nothing taken, nothing claimed)
    FLEET_DOWN = "fleet_down"  # Redis unreachable or slow: use the local markers


@dataclass(frozen=True, slots=True)
class WarmClaim:
    """One warm request as the fleet names it: `engine` is the fleet's engine id
    (`fleet_engine_id`, the same on every replica), `content_key` the target's last
    content key."""

    action: str
    engine: int
    content_key: int
    tenant: str
    tokens: float
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Rates:
    """The fleet's budgets: tokens a second and burst, per engine and per tenant."""

    engine_rate: float
    engine_burst: float
    tenant_rate: float
    tenant_burst: float


@dataclass(frozen=True, slots=True)
class FleetHeat:
    """The fleet's heat of some anchors: the replicas sharing heat (this one included)
    and, per anchor asked, the sum of their decayed request rates."""

    replicas: int
    rates: tuple[float, ...]


@dataclass
class ClaimStats:
    """Claims by result, releases that found another owner (or none), and calls that
    fell back to local state (Redis down or slow)."""

    results: Counter[str] = field(default_factory=Counter)
    lost: int = 0
    fallbacks: int = 0


class _Script:
    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def run(self, client: Redis, keys: list[str], args: list[str | int | float]) -> object:
        try:
            return await client.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:  # a restarted or flushed server: EVAL caches it again
            return await client.execute_command("EVAL", self.source, len(keys), *keys, *args)


_CLAIM = _Script(CLAIM)
_RELEASE = _Script(RELEASE)
_HEAT = _Script(HEAT)


class WarmClaims:
    """One replica's side of the fleet's warm claims (docs/state.md, "Warm-request
    claims")."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "quillcache",
        timeout_s: float = 0.05,
        retry_s: float = 1.0,
        margin_s: float = 1.0,
        client: Redis | None = None,
    ) -> None:
        if not prefix or any(ch in prefix for ch in "{}"):
            raise ConfigError(f"state prefix must be non-empty without braces, got {prefix!r}")
        if not timeout_s > 0 or not retry_s > 0 or margin_s < 0:
            raise ConfigError(
                f"timeout_s and retry_s must be > 0 and margin_s >= 0, got "
                f"{timeout_s}, {retry_s}, {margin_s}"
            )
        self.base = "{" + prefix + "}:"
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.margin_s = margin_s
        self.owner = secrets.token_hex(12)
        self.stats = ClaimStats()
        self._client = client or Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=timeout_s,
            socket_timeout=None,  # every call runs under its own timeout
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._down_until = -math.inf  # monotonic; Redis is not tried before then
        self._down = False

    def marker(self, claim: WarmClaim) -> str:
        return f"{self.base}warm:{claim.action}:{claim.engine}:{claim.content_key:016x}"

    def buckets(self, claim: WarmClaim) -> tuple[str, str]:
        return (
            f"{self.base}warmbudget:e:{claim.engine}",
            f"{self.base}warmbudget:t:{claim.tenant}",
        )

    async def claim(self, claim: WarmClaim, r: Rates) -> ClaimResult:
        """Claim the marker and take the tokens from both buckets (refilled at `r`), or
        neither."""
        reply = await self._call(
            _CLAIM,
            [self.marker(claim), *self.buckets(claim)],
            [
                self.owner,
                max(math.ceil((claim.ttl_s + self.margin_s) * 1000), 1),
                repr(float(claim.tokens)),
                repr(float(r.engine_rate)),
                repr(float(r.engine_burst)),
                repr(float(r.tenant_rate)),
                repr(float(r.tenant_burst)),
            ],
        )
        result = ClaimResult.FLEET_DOWN if reply is None else ClaimResult(str(reply))
        self.stats.results[result.value] += 1
        return result

    async def release(self, claim: WarmClaim, *, linger_s: float = 0.0) -> bool | None:
        """End this owner's claim: kept `linger_s` more (a success), else deleted. False:
        the marker was not this owner's (expired, or taken since); None: Redis down."""
        reply = await self._call(
            _RELEASE, [self.marker(claim)], [self.owner, max(math.ceil(linger_s * 1000), 0)]
        )
        if reply is None:
            return None
        if int(str(reply)) != 1:
            self.stats.lost += 1
            return False
        return True

    async def share_heat(
        self, rates: Sequence[tuple[int, float]], ttl_s: float
    ) -> FleetHeat | None:
        """Publish this replica's rates of hot anchors (anchor key, requests a second;
        the first `MAX_SHARED_ANCHORS`) for `ttl_s`, replacing what it published before,
        and read the fleet's: every replica that published within its TTL, and each
        anchor's rate summed over them. None: Redis down (use this replica's own)."""
        shared = rates[:MAX_SHARED_ANCHORS]
        args: list[str | int | float] = [
            self.owner,
            max(math.ceil(ttl_s * 1000), 1),
            f"{self.base}heat:",
        ]
        for key, rate in shared:
            args += (f"{key:016x}", repr(float(rate)))
        reply = await self._call(_HEAT, [f"{self.base}heaters"], args)
        if reply is None:
            return None
        assert isinstance(reply, list)
        return FleetHeat(int(reply[0]), tuple(float(x) for x in reply[1:]))

    async def _call(
        self, script: _Script, keys: list[str], args: list[str | int | float]
    ) -> object:
        """The script's reply, or None: Redis down, slow or failing (counted, logged
        once per outage), and not tried again for `retry_s`."""
        now = time.monotonic()
        if now < self._down_until:
            self.stats.fallbacks += 1
            return None
        try:
            reply = await asyncio.wait_for(script.run(self._client, keys, args), self.timeout_s)
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.fallbacks += 1
            self._down_until = time.monotonic() + self.retry_s
            if not self._down:
                self._down = True
                log.warning(
                    "policy: warm claims in redis failed (%s: %s); warm requests use this "
                    "replica's own markers and budgets until redis answers",
                    type(exc).__name__,
                    exc,
                )
            # the connection may be mid-reply: a fresh one next time
            with contextlib.suppress(RedisError, OSError):
                await self._client.connection_pool.disconnect()
            return None
        if self._down:
            self._down = False
            log.warning("policy: warm claims in redis again")
        return reply

    async def aclose(self) -> None:
        await self._client.aclose()
