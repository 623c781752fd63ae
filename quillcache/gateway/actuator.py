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

A replica whose prefix the index shows offloaded in another engine's LMCache CPU tier
(an `Offload`) is copied there instead of recomputed, when both engines are LMCache
instances of a configured controller (`lmcache`): once the claim is taken, LMCache's
`/lookup` confirms an instance holding it, `/move` with `should_copy` sends its chunks
into the target's CPU tier, `/check_finish` asks for the event; the warm request that
follows then loads them (the engine computes only what was not moved) and puts them in
the target's GPU cache, whose KV events show the replica to the index (LMCache announces
no chunk it received). A move that fails, finds nothing or is not possible leaves the
warm request to recompute the prefix, within the budget: the tokens the move was
expected to save are taken then, or the warm is skipped (`budget`).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from quillcache.gateway.lmcache_ctl import CPU_LOCATION, LmcacheController, LmcacheError
from quillcache.gateway.shared_routing import fleet_engine_id
from quillcache.gateway.workers import Worker
from quillcache.policy.budget import ActuationBudget
from quillcache.policy.retention import WarmAction
from quillcache.policy.targets import Target
from quillcache.state.warm_claims import ClaimResult, Rates, WarmClaim, WarmClaims

log = logging.getLogger(__name__)

#: What became of a warm request (the `outcome` label of its metric).
OUTCOMES = ("ok", "failed", "timeout", "budget", "in_flight", "engine_down")


#: What became of an attempt to copy a replica with LMCache's controller (the `outcome`
#: label of its metric): `ok` (chunks moved), `not_found` (no other instance holds at
#: least `min_move_tokens` of it), `empty` (the source had none: nothing moved),
#: `failed` (an error answer), `timeout`.
MOVE_OUTCOMES = ("ok", "not_found", "empty", "failed", "timeout")


@dataclass(frozen=True, slots=True)
class Offload:
    """The index shows `blocks` of a target's prefix in `source`'s LMCache CPU tier."""

    source: Worker
    blocks: int


@dataclass
class MoveStats:
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    tokens: int = 0  # tokens LMCache reported moved
    unfinished: int = 0  # /check_finish answered a status other than finished


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
        lmcache: LmcacheController | None = None,
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
        self.lmcache = lmcache
        self.moves = MoveStats()

    async def aclose(self) -> None:
        if self.claims is not None:
            await self.claims.aclose()

    def in_flight(self, engine: int, target: Target) -> bool:
        return (engine, target.id) in self._in_flight

    async def warm(
        self,
        worker: Worker,
        target: Target,
        action: WarmAction,
        cached_blocks: int,
        offload: Offload | None = None,
    ) -> str:
        """Send `target`'s prefix to `worker`; the outcome (one of `OUTCOMES`). The budget
        is charged the tokens the engine computes: the prefix beyond `cached_blocks`
        (at least one token: a fully cached prompt still computes its last), and beyond
        what `offload` lets LMCache move there (with a controller)."""
        if self.lmcache is None or offload is None or offload.source.id == worker.id:
            offload = None
        outcome = await self._warm(worker, target, action, cached_blocks, offload)
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
        self,
        worker: Worker,
        target: Target,
        action: WarmAction,
        cached_blocks: int,
        offload: Offload | None,
    ) -> str:
        if not worker.healthy:
            return "engine_down"
        key = (worker.id, target.id)
        if key in self._in_flight:
            return "in_flight"
        cached = min(cached_blocks * self.block_size, target.tokens)
        moved = 0 if offload is None else min(offload.blocks * self.block_size, target.tokens)
        tokens = max(target.tokens - max(cached, moved), 1)  # charged up front
        # marked before the claim's round trip: this replica's own tasks never race it
        self._in_flight.add(key)
        try:
            # a slot first: a marker's TTL (timeout + margin) then covers the whole warm
            async with self._gate:
                outcome, tokens = await self._claimed(
                    worker, target, action, tokens, offload, cached
                )
        finally:
            self._in_flight.discard(key)
        if outcome == "ok":
            self.stats.tokens[action.value] += tokens
        return outcome

    async def _claimed(
        self,
        worker: Worker,
        target: Target,
        action: WarmAction,
        tokens: int,
        offload: Offload | None,
        cached: int = 0,
    ) -> tuple[str, int]:
        """Claim the fleet's marker and budget (shared state up), else this replica's
        budget; move the offloaded copy (`offload`); then send. The outcome and the
        tokens the engine computes."""
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
                return "in_flight", tokens
            if claimed is ClaimResult.BUDGET:
                return "budget", tokens
            if claimed is ClaimResult.FLEET_DOWN:
                claim = None
        if claim is None and not self.budget.take(
            worker.id, target.tenant, tokens, time.monotonic()
        ):
            return "budget", tokens
        outcome = "failed"
        try:
            if offload is not None:
                moved = await self._move(worker, target, offload)
                computed = max(target.tokens - max(cached, moved), 1)
                if computed > tokens:  # moved less than expected: the rest is recomputed
                    extra = computed - tokens
                    if not self.budget.take(worker.id, target.tenant, extra, time.monotonic()):
                        outcome = "budget"
                        return outcome, tokens
                    tokens = computed
            outcome = await self._send(worker, target)
        finally:
            if claim is not None:
                # a success keeps the fleet's marker: "recently placed" for linger_s
                await self._release(claim, outcome == "ok")
        return outcome, tokens

    async def _move(self, worker: Worker, target: Target, offload: Offload) -> int:
        """Copy `target`'s chunks from the LMCache instance holding them into `worker`'s
        CPU tier; the tokens moved (0: none, the warm request recomputes them)."""
        assert self.lmcache is not None
        outcome, moved = "failed", 0
        dst = self.lmcache.instance_of(worker.url)
        try:
            if dst is None or self.lmcache.instance_of(offload.source.url) is None:
                outcome = "not_found"  # not both LMCache instances of this controller
                return 0
            source = await self._source(dst, target)
            if source is None:
                outcome = "not_found"
                return 0
            (instance, location), end = source
            event, moved = await self.lmcache.move(
                (instance, location), (dst, CPU_LOCATION), target.token_ids[:end], copy=True
            )
            outcome = "ok" if moved else "empty"
            if moved:
                self.moves.tokens += moved
                # 0.5.6 answers /move once the transfer is done and tracks no events
                status = await self.lmcache.check_finish(event)
                if status is not None and status.lower() != "finished":
                    self.moves.unfinished += 1
            return moved
        except LmcacheError as exc:
            outcome = "timeout" if exc.status == 0 and "no answer" in exc.detail else "failed"
            log.info("policy: LMCache move of %r to engine %d: %s", target.name, worker.id, exc)
            return 0
        finally:
            self.moves.outcomes[outcome] += 1

    async def _source(self, dst: str, target: Target) -> tuple[tuple[str, str], int] | None:
        """LMCache's own view (`/lookup`): the instance other than `dst` holding the
        longest prefix of the target in the configured location, if long enough."""
        assert self.lmcache is not None
        layout = await self.lmcache.lookup(target.token_ids)
        where = self.lmcache.settings.location
        best = max(
            ((end, inst) for inst, (loc, end) in layout.items() if inst != dst and loc == where),
            default=None,
        )
        if best is None or best[0] < self.lmcache.settings.min_move_tokens:
            return None
        return (best[1], where), best[0]

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
