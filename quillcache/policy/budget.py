"""Prefill-token budgets for the policy engine's own requests.

Every warm request (a prefetch, a replica, a retention touch) costs the engine prefill
work that serving requests would otherwise get. Token buckets bound it per engine and
per tenant: `rate` tokens a second, up to `burst` at once; a request is sent only when
both its engine's and its tenant's buckets hold its tokens, and then takes them from
both.

These are one replica's buckets. With shared state the same buckets (same rates, same
bursts, both or neither) are kept in Redis for the whole fleet
(`quillcache.state.warm_claims`), and these apply only while Redis is unreachable.
"""

from __future__ import annotations

from collections.abc import Hashable

#: The budgets' defaults (the gateway's `PolicyConfig`, the simulator's
#: `RetainSettings`): prefill tokens a second per engine and per tenant, and the
#: seconds of that rate a bucket holds.
ENGINE_TOKENS_PER_S = 4096.0
TENANT_TOKENS_PER_S = 2048.0
BURST_S = 8.0


class TokenBuckets:
    """Token buckets by key, refilled at `rate` per second up to `burst`."""

    def __init__(self, rate: float, burst: float) -> None:
        if rate < 0 or burst < 0:
            raise ValueError(f"rate and burst must be >= 0, got {rate} and {burst}")
        self.rate = rate
        self.burst = burst
        self._level: dict[Hashable, tuple[float, float]] = {}  # key -> (tokens, at_s)

    def level(self, key: Hashable, now_s: float) -> float:
        tokens, at = self._level.get(key, (self.burst, now_s))
        return min(self.burst, tokens + max(now_s - at, 0.0) * self.rate)

    def take(self, key: Hashable, tokens: float, now_s: float) -> bool:
        have = self.level(key, now_s)
        if tokens > have:
            return False
        self._level[key] = (have - tokens, now_s)
        return True


class ActuationBudget:
    """The per-engine and per-tenant buckets together: both must hold a request's
    tokens, and it takes from both or from neither."""

    def __init__(self, *, engine_rate: float, tenant_rate: float, burst_s: float) -> None:
        self.engines = TokenBuckets(engine_rate, engine_rate * burst_s)
        self.tenants = TokenBuckets(tenant_rate, tenant_rate * burst_s)

    def take(self, engine: int, tenant: str, tokens: float, now_s: float) -> bool:
        if tokens > self.engines.level(engine, now_s) or tokens > self.tenants.level(tenant, now_s):
            return False
        self.engines.take(engine, tokens, now_s)
        self.tenants.take(tenant, tokens, now_s)
        return True
