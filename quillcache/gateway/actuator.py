"""The policy engine's one actuator: a one-token completion carrying a prefix.

Any OpenAI-compatible engine with prefix caching keeps what it computed for a prompt,
and a prompt it already holds moves those blocks to the most recently used end of its
LRU. So one request with the prefix's token ids and `max_tokens: 1` places a prefix on
an engine (prefetch, replication) or keeps it there (retention), on engines as they
are. The request carries the owner tenant's derived `cache_salt`, so that it fills the
namespace the owner's requests read.

Every warm request is idempotent (skipped while one for the same target and engine is
in flight, fleet-wide with shared state: `claims`), bounded (token budgets per engine
and per tenant, `policy.budget`; at most `max_concurrent` at once; a timeout), and
counted by action and outcome. It never
blocks routing: a dead engine only fails its own warm requests.

With shared state (`state: redis://...`) the in-flight marker and the budgets are the
fleet's (`quillcache.state.warm_claims`): one round trip claims the marker and takes the
tokens from the fleet's buckets, the marker lingers `linger_s` after a success (the
fleet-wide `touch_min_interval_s`), and with Redis down or slow the warm falls back to
this replica's own marker and budgets.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from quillcache.gateway.shared_routing import fleet_engine_id
from quillcache.gateway.workers import Worker
from quillcache.policy.budget import ActuationBudget
from quillcache.policy.retention import WarmAction
from quillcache.policy.targets import Target
from quillcache.state.warm_claims import ClaimResult, Rates, WarmClaim, WarmClaims

log = logging.getLogger(__name__)

#: What became of a warm request (the `outcome` label of its metric).
OUTCOMES = ("ok", "failed", "timeout", "budget", "in_flight", "engine_down")


@dataclass
class ActuatorStats:
    """Counts by (action, outcome), prefill tokens sent by action, and each sent
    request's duration (bounded)."""

    outcomes: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    tokens: collections.Counter[str] = field(default_factory=collections.Counter)
    seconds: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=1024)
    )


class Warmer:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        budget: ActuationBudget,
        *,
        block_size: int,
        timeout_s: float,
        max_concurrent: int,
        claims: WarmClaims | None = None,
        linger_s: float = 0.0,
    ) -> None:
        self._session = session
        self.budget = budget
        self.block_size = block_size
        self.timeout_s = timeout_s
        self._gate = asyncio.Semaphore(max_concurrent)
        self._in_flight: set[tuple[int, tuple[object, ...]]] = set()
        self.stats = ActuatorStats()
        self.claims = claims
        self.linger_s = linger_s
        self._rates = Rates(
            budget.engines.rate, budget.engines.burst, budget.tenants.rate, budget.tenants.burst
        )

    async def aclose(self) -> None:
        if self.claims is not None:
            await self.claims.aclose()

    def in_flight(self, engine: int, target: Target) -> bool:
        return (engine, target.id) in self._in_flight

    async def warm(
        self, worker: Worker, target: Target, action: WarmAction, cached_blocks: int
    ) -> str:
        """Send `target`'s prefix to `worker`; the outcome (one of `OUTCOMES`). The budget
        is charged the tokens the engine computes: the prefix beyond `cached_blocks`
        (at least one token: a fully cached prompt still computes its last)."""
        outcome = await self._warm(worker, target, action, cached_blocks)
        self.stats.outcomes[(action.value, outcome)] += 1
        if outcome not in ("ok", "in_flight"):
            log.info(
                "policy: %s of %s %r on engine %d: %s",
                action.value,
                target.kind.value,
                target.name,
                worker.id,
                outcome,
            )
        return outcome

    async def _warm(
        self, worker: Worker, target: Target, action: WarmAction, cached_blocks: int
    ) -> str:
        if not worker.healthy:
            return "engine_down"
        key = (worker.id, target.id)
        if key in self._in_flight:
            return "in_flight"
        tokens = max(target.tokens - cached_blocks * self.block_size, 1)
        # marked before the claim's round trip: this replica's own tasks never race it
        self._in_flight.add(key)
        try:
            # a slot first: a marker's TTL (timeout + margin) then covers the whole warm
            async with self._gate:
                outcome = await self._claimed(worker, target, action, tokens)
        finally:
            self._in_flight.discard(key)
        if outcome == "ok":
            self.stats.tokens[action.value] += tokens
        return outcome

    async def _claimed(
        self, worker: Worker, target: Target, action: WarmAction, tokens: int
    ) -> str:
        """Claim the fleet's marker and budget (shared state up), else this replica's
        budget; then send."""
        claim: WarmClaim | None = None
        if self.claims is not None and len(target.keys):
            claim = WarmClaim(
                action=action.value,
                engine=fleet_engine_id(worker.url),
                content_key=int(target.keys[-1]),
                tenant=target.tenant,
                tokens=tokens,
                ttl_s=self.timeout_s,
            )
            claimed = await self.claims.claim(claim, self._rates)
            if claimed is ClaimResult.IN_FLIGHT:
                # another replica warms it, or did less than linger_s ago: as if here
                target.touched_s[worker.id] = time.monotonic()
                return "in_flight"
            if claimed is ClaimResult.BUDGET:
                return "budget"
            if claimed is ClaimResult.FLEET_DOWN:
                claim = None
        if claim is None and not self.budget.take(
            worker.id, target.tenant, tokens, time.monotonic()
        ):
            return "budget"
        outcome = "failed"
        try:
            outcome = await self._send(worker, target)
        finally:
            if claim is not None:
                # a success keeps the fleet's marker: "recently placed" for linger_s
                await self._release(claim, outcome == "ok")
        return outcome

    async def _release(self, claim: WarmClaim, ok: bool) -> None:
        assert self.claims is not None
        await self.claims.release(claim, linger_s=self.linger_s if ok else 0.0)

    async def _send(self, worker: Worker, target: Target) -> str:
        body: dict[str, object] = {
            "model": target.model,
            "prompt": target.token_ids,
            "max_tokens": 1,
            "temperature": 0.0,
            "stream": False,
        }
        if target.salt is not None:
            body["cache_salt"] = target.salt
        target.touched_s[worker.id] = time.monotonic()
        started = time.perf_counter()
        try:
            async with self._session.post(
                worker.url + "/v1/completions",
                json=body,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                await resp.read()
                if resp.status != 200:
                    return "failed"
        except TimeoutError:
            return "timeout"
        except aiohttp.ClientError:
            return "failed"
        finally:
            self.stats.seconds.append(time.perf_counter() - started)
        return "ok"
