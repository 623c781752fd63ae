"""The policy engine in the gateway: its targets, its decisions every `interval_s`, and
the warm requests that carry them out (docs/policy.md).

Pins come from the admin API (`admin.py`), session retention from requests' hints
(`openai_api.py`). Both are retention targets (`policy.targets`): the plane prefers
their holders when routing (`ControlPlane.pin`), and every tick the loop expires the
lapsed ones, measures each engine's rate of new blocks from the index's events, and sends
the warm requests `policy.retention.plan` finds due (`actuator.Warmer`), as tasks that
never hold up routing.

Hot-prefix replication (`policy.replication`, off by default): routed requests feed a
`policy.hot.HotPrefixes` (their anchors' heat; the tokens of the hot ones, tenant-scoped),
and every tick `policy.replication.ReplicationPolicy` looks at the hot prefixes' holders
(the index) and every engine's wait (queued prefill plus, where slots are all taken, the
wait for one: `_wait_s`); each replica it decides is one warm request to the idle engine
with the owner's salt, within the same budgets, skipped when the index shows the prefix
there already or one is in flight. Where LMCache serves as the offload tier and its
controller is attached (`attach_lmcache`), a replica the index shows in another engine's
LMCache CPU tier is moved there by the controller before that request, which then loads
it instead of computing it (`actuator.Offload`).

With shared state the fleet keeps the pins (Redis, `fleet.py`) and pins them in every
replica's plane; the replica that took a pin keeps its tokens and retains it. Every warm
request then claims a fleet-wide marker and the fleet's budgets first (the Warmer's
`claims`, `quillcache.state.warm_claims`), so N replicas deciding the same warm send it
once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quillcache.controlplane import ControlPlane, UnknownWorkerError
from quillcache.gateway.actuator import Offload, Warmer
from quillcache.gateway.config import PolicyConfig
from quillcache.gateway.lmcache_ctl import LmcacheController
from quillcache.gateway.session_hints import SessionHint
from quillcache.gateway.workers import WorkerPool
from quillcache.policy.hot import HotCopy, HotPrefixes, Owner
from quillcache.policy.replication import EngineLoad, ReplicationConfig, ReplicationPolicy
from quillcache.policy.retention import BlockRates, TouchTiming, Warm, WarmAction, plan
from quillcache.policy.targets import (
    KeyArray,
    Target,
    TargetBudgetError,
    TargetId,
    TargetKind,
    TargetStore,
)
from quillcache.routing.types import tier_of
from quillcache.state.warm_claims import ClaimStats

#: A replica's shared heat lives this many policy ticks: one that stops ticking (dead,
#: or replication turned off) leaves the fleet's sum and count within that.
HEAT_TICKS = 3

log = logging.getLogger(__name__)


class PolicyEngine:
    def __init__(
        self,
        config: PolicyConfig,
        *,
        plane: ControlPlane,
        pool: WorkerPool,
        warmer: Warmer,
        pins_in_plane: bool = True,
    ) -> None:
        self.config = config
        self.plane = plane
        self.pool = pool
        self.warmer = warmer
        # False with shared state: the fleet pins and unpins every replica's plane
        self.pins_in_plane = pins_in_plane
        self.store = TargetStore(
            max_tokens=config.retention_max_tokens, pin_budget_tokens=config.pin_budget_tokens
        )
        self.rates = BlockRates()
        self.timing = TouchTiming(
            config.touch_min_interval_s, config.touch_max_interval_s, config.touch_safety
        )
        self._tasks: set[asyncio.Task[str]] = set()
        self.ticks = 0
        self.dropped_hints = 0  # session hints the store had no room for
        self.heat_replicas = 1  # replicas sharing their heat, at the last tick
        rep = config.replication
        self.hot: HotPrefixes | None = None
        if rep.enabled:
            self.hot = HotPrefixes(
                block_size=plane.block_size,
                min_rate=rep.min_rate,
                min_blocks=rep.min_blocks,
                half_life_s=rep.half_life_s,
                max_anchors=rep.max_anchors,
                max_tokens=rep.max_tokens,
            )
        self._replication_config = ReplicationConfig(
            high_wait_s=rep.high_wait_s,
            low_wait_s=rep.low_wait_s,
            cooldown_s=rep.cooldown_s,
            max_replicas=rep.max_replicas,
        )
        # one policy per set of engines serving the hot prefixes' model (None: all)
        self._replication: dict[frozenset[int] | None, ReplicationPolicy] = {}
        self.replicas_decided = 0
        self.replicas_held = 0  # decided, but the index shows it there already
        self._offload_keys: Callable[[str, list[int]], KeyArray] | None = None

    @property
    def lmcache(self) -> LmcacheController | None:
        """LMCache's controller, where LMCache serves as the offload tier (replicas are
        moved through it; the admin API clears its tiers)."""
        return self.warmer.lmcache

    def attach_lmcache(
        self,
        controller: LmcacheController,
        offload_keys: Callable[[str, list[int]], KeyArray] | None = None,
    ) -> None:
        """Move replicas with LMCache's controller. `offload_keys(model, tokens)`: the
        keys under which the index holds LMCache's chunks of a prompt, the namespace
        without a salt (in-process LMCache keys chunks by tokens alone and its events
        name no salt); None: a target's own keys (its owner has no salt)."""
        self.warmer.lmcache = controller
        self._offload_keys = offload_keys

    # -- heat ----------------------------------------------------------------------------

    @property
    def wants_tokens(self) -> bool:
        """Whether routed requests' token ids are asked for (`routed`): replication on."""
        return self.hot is not None

    def routed(
        self, keys: KeyArray, tokens: list[int], *, tenant: str, salt: str | None, model: str
    ) -> None:
        """A request was routed: count its anchors' heat (O(anchors)), and keep the
        tokens of a hot anchor that has none, as this tenant's (`policy.hot`)."""
        if self.hot is None or not len(keys):
            return
        self.hot.observe(keys, tokens, Owner(tenant, salt, model), time.monotonic())

    # -- targets -------------------------------------------------------------------------

    def retain(self, target: Target) -> None:
        """Add or replace a target (its budget checked by the store: `TargetBudgetError`);
        its prefix is pinned in the plane (index nodes kept, holders preferred)."""
        old = self.store.put(target)
        if self._plane_pins(target.kind):
            self.plane.pin(target.keys, target.engine)
            if old is not None:
                self.plane.unpin(old.keys)
        if old is not None:  # a new turn of a session on the same engine: no re-warm
            target.touched_s = {e: s for e, s in old.touched_s.items() if e == target.engine}

    def session_turn(
        self,
        hint: SessionHint,
        *,
        tenant: str,
        salt: str | None,
        model: str,
        keys: KeyArray,
        tokens: list[int],
        engine: int,
    ) -> None:
        """A request with a retention hint went to `engine`: its prompt (whole blocks)
        becomes the session's target there for the hint's TTL, replacing the previous
        turn's. A full store drops the hint (counted, logged): a hint never fails its
        request."""
        if not len(keys):
            return
        now = time.monotonic()
        name = hint.session_id if hint.session_id is not None else f"prefix:{int(keys[-1])}"
        target = Target(
            kind=TargetKind.SESSION,
            tenant=tenant,
            name=name,
            keys=keys,
            token_ids=tokens[: len(keys) * self.plane.block_size],
            model=model,
            salt=salt,
            expires_s=now + hint.ttl_s,
            engine=engine,
        )
        try:
            self.retain(target)
        except TargetBudgetError as exc:
            self.dropped_hints += 1
            log.warning("policy: session hint of tenant %r dropped: %s", tenant, exc)
            return
        target.touched_s[engine] = now  # the turn itself used the prefix there

    def release(self, target_id: TargetId) -> Target | None:
        target = self.store.remove(target_id)
        if target is not None and self._plane_pins(target.kind):
            self.plane.unpin(target.keys)
        return target

    def _plane_pins(self, kind: TargetKind) -> bool:
        return self.pins_in_plane or kind is TargetKind.SESSION

    # -- the loop ------------------------------------------------------------------------

    async def tick(self) -> list[Warm]:
        """One round: expire, measure, decide, send (without waiting for the answers)."""
        now = time.monotonic()
        self.ticks += 1
        for gone in self.store.expire(now):
            if self._plane_pins(gone.kind):
                self.plane.unpin(gone.keys)
            log.info("policy: %s %r of tenant %r expired", gone.kind.value, gone.name, gone.tenant)
        if not self.pins_in_plane:  # the fleet's pins: one unpinned through any replica
            for t in self.store:
                if t.kind is TargetKind.PIN and self.plane.pinned.longest(t.keys) < len(t.keys):
                    self.store.remove(t.id)
        known: set[int] = set()
        for state in self.plane.workers():
            known.add(state.worker)
            self.rates.observe(state.worker, state.stored_blocks, now)
        replicas = await self._replicate(now) if self.hot is not None else []
        if not len(self.store):
            return replicas
        self._forget_removed(known)
        due = plan(
            self.store,
            holders_of=self.plane.holders,
            computing_of=self.plane.computing,
            room_blocks=self._room_blocks,
            interval_s=self._interval_s,
            place=self._place,
            now_s=now,
            min_interval_s=self.config.touch_min_interval_s,
        )
        for warm in due:
            self._send(warm)
        return due + replicas

    def _forget_removed(self, known: set[int]) -> None:
        """Engines removed since the targets were kept there (`DELETE /admin/workers`,
        or the fleet's): a session bound to one is bound again by its next turn, and
        no target is warmed there."""
        for t in self.store:
            if t.engine is not None and t.engine not in known:
                log.info(
                    "policy: session %r of tenant %r lost its engine %d (removed)",
                    t.name,
                    t.tenant,
                    t.engine,
                )
                t.engine = None
            for gone in [e for e in t.touched_s if e not in known]:
                del t.touched_s[gone]

    async def _hot(self, now: float) -> list[HotCopy]:
        """The hot prefixes this tick. With shared state the replicas share their heat
        (`WarmClaims.share_heat`): this replica lists (and copies) the anchors at its
        share of `min_rate`, and keeps those whose rate summed over the fleet reaches
        it, at the fleet's rate. Redis down: this replica's own rate against the whole
        `min_rate`, as without shared state."""
        hot = self.hot
        assert hot is not None
        copies = hot.hot(now)
        claims = self.warmer.claims
        if claims is None:
            return copies
        ttl_s = HEAT_TICKS * self.config.interval_s
        fleet = await claims.share_heat([(c.prefix.key, c.prefix.rate) for c in copies], ttl_s)
        if fleet is None:
            return hot.at_fleet_rates(copies, None, ())
        self.heat_replicas = fleet.replicas
        return hot.at_fleet_rates(copies, fleet.replicas, fleet.rates)

    async def _replicate(self, now: float) -> list[Warm]:
        """Decide the replicas of the hot prefixes (by the set of engines serving their
        model) and send them."""
        by_serving: dict[frozenset[int] | None, list[HotCopy]] = {}
        for c in await self._hot(now):
            by_serving.setdefault(self.pool.serving(c.owner.model), []).append(c)
        sent: list[Warm] = []
        for serving, copies in by_serving.items():
            policy = self._replication.get(serving)
            if policy is None:
                policy = self._replication[serving] = ReplicationPolicy(self._replication_config)
            loads = [
                EngineLoad(w.id, self._wait_s(w.id))
                for w in self.pool.workers.values()
                if w.healthy and not w.draining and (serving is None or w.id in serving)
            ]
            by_key = {c.prefix.key: c for c in copies}
            held = {c.prefix.key: self.plane.holders(c.keys) for c in copies}
            computing = {c.prefix.key: self.plane.computing(c.keys) for c in copies}
            decided = policy.decide([c.prefix for c in copies], held, loads, now, computing)
            for r in decided:
                self.replicas_decided += 1
                c = by_key[r.prefix_key]
                target = Target(
                    kind=TargetKind.HOT,
                    tenant=c.owner.tenant,
                    name=str(r.prefix_key),
                    keys=c.keys,
                    token_ids=c.token_ids,
                    model=c.owner.model,
                    salt=c.owner.salt,
                    expires_s=math.inf,
                )
                if r.target_worker in self.plane.holders(target.keys):
                    self.replicas_held += 1
                    continue
                self._send_target(target, r.target_worker, WarmAction.REPLICATE)
                sent.append(Warm(target.id, r.target_worker, WarmAction.REPLICATE))
        return sent

    def _wait_s(self, engine: int) -> float:
        """An engine's estimated wait for a new request: its queued prefill, plus the
        wait for a sequence slot when all `max_num_seqs` are taken (the engine's own when
        configured, else the cost model's);
        the queued prefill alone understates a holder whose hits keep prefill short
        while its slots fill."""
        state = self.plane.worker(engine)
        slot = self.plane.cost.slot_wait_time(
            state.in_flight,
            state.running_decodes,
            state.mean_context_tokens,
            self.config.replication.output_tokens,
            state.max_num_seqs,
        )
        return self.plane.queue_wait_s(engine) + slot

    def _interval_s(self, engine: int) -> float:
        """Without the engine's capacity, what it holds (by the index): the same once it
        is full, less (touches sooner) while it is not."""
        try:
            state = self.plane.worker(engine)
        except UnknownWorkerError:  # removed since the index named it: never due
            return math.inf
        size = state.capacity_blocks or state.resident_blocks
        return self.timing.interval_s(size, self.rates.rate(engine))

    def _room_blocks(self, engine: int) -> float:
        """The blocks retention may keep on `engine`: its share of the engine's capacity
        (unbounded while the capacity is not known; none on an engine removed since the
        index named it)."""
        try:
            capacity = self.plane.worker(engine).capacity_blocks
        except UnknownWorkerError:
            return 0.0
        return self.config.retention_max_engine_share * capacity if capacity else math.inf

    def _place(self, target: Target) -> int | None:
        """Where a pin nobody holds goes: the healthy engine serving its model with the
        shortest estimated queue (lowest id on a tie)."""
        serving = self.pool.serving(target.model)
        best: tuple[float, int] | None = None
        for w in self.pool.workers.values():
            if not w.healthy or w.draining or (serving is not None and w.id not in serving):
                continue
            key = (self.plane.queue_wait_s(w.id), w.id)
            if best is None or key < best:
                best = key
        return best[1] if best is not None else None

    def _send(self, warm: Warm) -> None:
        target = self.store.get(warm.target)
        if target is not None:
            self._send_target(target, warm.engine, warm.action)

    def _send_target(self, target: Target, engine: int, action: WarmAction) -> None:
        worker = self.pool.workers.get(engine)
        if worker is None:
            return
        cached = 0
        n = len(target.keys)
        for m in self.plane.match(target.keys):
            if m.worker == engine and m.medium == "GPU":
                cached = max(cached, min(m.blocks, n))
        offload = None
        if action is WarmAction.REPLICATE and self.lmcache is not None:
            offload = self._offloaded(target, engine)
        task = asyncio.create_task(self.warmer.warm(worker, target, action, cached, offload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _offloaded(self, target: Target, engine: int) -> Offload | None:
        """The engine other than `engine` whose LMCache CPU tier holds the most of the
        target, by the index (None: none does)."""
        keys = target.keys
        if self._offload_keys is not None and target.salt:
            keys = self._offload_keys(target.model, target.token_ids)
        best: Offload | None = None
        for m in self.plane.match(keys):
            if m.worker == engine or tier_of(m.medium) != "cpu":
                continue
            source = self.pool.workers.get(m.worker)
            if source is not None and (best is None or m.blocks > best.blocks):
                best = Offload(source, min(m.blocks, len(target.keys)))
        return best

    async def drain(self) -> None:
        """Wait for the warm requests in flight (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.warmer.aclose()

    # -- reporting -----------------------------------------------------------------------

    def describe(self, target: Target) -> dict[str, Any]:
        now = time.monotonic()
        return {
            "kind": target.kind.value,
            "name": target.name,
            "owner": target.tenant,
            "blocks": len(target.keys),
            "tokens": target.tokens,
            "model": target.model,
            "ttl_left_s": max(target.expires_s - now, 0.0),
            "engine": target.engine,
            "holders": sorted(self.plane.holders(target.keys)),
            "touched_s_ago": {
                str(e): round(now - s, 3) for e, s in sorted(target.touched_s.items())
            },
        }

    def collect(self) -> Iterator[Any]:
        stats = self.warmer.stats
        actions = CounterMetricFamily(
            "quillcache_policy_warm_requests",
            "The policy engine's warm requests by action and outcome",
            labels=["action", "outcome"],
        )
        for (action, outcome), n in sorted(stats.outcomes.items()):
            actions.add_metric([action, outcome], n)
        yield actions
        tokens = CounterMetricFamily(
            "quillcache_policy_prefill_tokens",
            "Prefill tokens the policy engine's warm requests cost engines, by action",
            labels=["action"],
        )
        for action, n in sorted(stats.tokens.items()):
            tokens.add_metric([action], n)
        yield tokens
        targets = GaugeMetricFamily(
            "quillcache_policy_targets", "Retention targets by kind", labels=["kind"]
        )
        kept = GaugeMetricFamily(
            "quillcache_policy_target_tokens",
            "Prompt tokens the policy engine keeps for its targets",
        )
        counts: dict[TargetKind, int] = {k: 0 for k in TargetKind if k is not TargetKind.HOT}
        for t in self.store:
            counts[t.kind] += 1
        for kind, n in counts.items():
            targets.add_metric([kind.value], n)
        kept.add_metric([], self.store.tokens)
        yield targets
        yield kept
        dropped = CounterMetricFamily(
            "quillcache_policy_dropped_hints",
            "Session retention hints dropped: the retention store was full",
        )
        dropped.add_metric([], self.dropped_hints)
        yield dropped
        if self.hot is not None:
            yield from self._collect_hot(self.hot)
        if self.warmer.claims is not None:
            yield from self._collect_claims(self.warmer.claims.stats)
        if self.lmcache is not None:
            yield from self._collect_lmcache(self.lmcache)
        if stats.seconds:
            slowest = GaugeMetricFamily(
                "quillcache_policy_warm_seconds_max",
                "The longest of the last warm requests' durations",
            )
            slowest.add_metric([], max(stats.seconds))
            yield slowest

    def _collect_claims(self, stats: ClaimStats) -> Iterator[Any]:
        claims = CounterMetricFamily(
            "quillcache_policy_fleet_claims",
            "Fleet-wide warm claims in Redis by result (fleet_down: this replica's own "
            "marker and budgets were used)",
            labels=["result"],
        )
        for result, n in sorted(stats.results.items()):
            claims.add_metric([result], n)
        yield claims
        fallbacks = CounterMetricFamily(
            "quillcache_policy_fleet_claim_fallbacks",
            "Warm-claim calls that fell back to local state: redis unreachable or slow",
        )
        fallbacks.add_metric([], stats.fallbacks)
        yield fallbacks

    def _collect_lmcache(self, controller: LmcacheController) -> Iterator[Any]:
        moves = self.warmer.moves
        outcomes = CounterMetricFamily(
            "quillcache_policy_lmcache_moves",
            "Replicas the policy engine tried to copy with LMCache's controller, by outcome "
            "(ok: chunks moved; otherwise the warm request recomputed them)",
            labels=["outcome"],
        )
        for outcome, n in sorted(moves.outcomes.items()):
            outcomes.add_metric([outcome], n)
        yield outcomes
        tokens = CounterMetricFamily(
            "quillcache_policy_lmcache_moved_tokens",
            "Tokens LMCache's controller reported moved for the policy engine's replicas",
        )
        tokens.add_metric([], moves.tokens)
        yield tokens
        calls = CounterMetricFamily(
            "quillcache_lmcache_controller_calls",
            "Calls to LMCache's controller by call and result",
            labels=["call", "result"],
        )
        for (call, result), n in sorted(controller.calls.items()):
            calls.add_metric([call, result], n)
        yield calls

    def _collect_hot(self, hot: HotPrefixes) -> Iterator[Any]:
        decided = CounterMetricFamily(
            "quillcache_policy_decisions",
            "The policy engine's decisions by action (each replicate decision is then sent "
            "or skipped: quillcache_policy_warm_requests)",
            labels=["action"],
        )
        decided.add_metric([WarmAction.REPLICATE.value], self.replicas_decided)
        yield decided
        held = CounterMetricFamily(
            "quillcache_policy_replicas_held",
            "Replicas decided but not sent: the index showed the prefix on the target",
        )
        held.add_metric([], self.replicas_held)
        yield held
        copies = GaugeMetricFamily(
            "quillcache_policy_hot_tokens",
            "Prompt tokens the policy engine keeps for hot prefixes (their replicas' copies)",
        )
        copies.add_metric([], hot.tokens)
        yield copies
        anchors = GaugeMetricFamily(
            "quillcache_policy_hot_anchors", "Prefix anchors whose heat is tracked"
        )
        anchors.add_metric([], len(hot.heat))
        yield anchors
        heaters = GaugeMetricFamily(
            "quillcache_policy_heat_replicas",
            "Gateway replicas sharing their hot-prefix heat through the shared state at the "
            "last tick (1: this one alone, or local state); an anchor is copied at "
            "min_rate divided by it and replicated at the fleet's summed rate",
        )
        heaters.add_metric([], self.heat_replicas)
        yield heaters


def ttl_of(raw: object, default_s: float, max_s: float, what: str = "ttl_s") -> float:
    """A TTL hint in seconds: `default_s` when absent; ValueError naming the limit."""
    if raw is None:
        return default_s
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise ValueError(f"'{what}' must be a number of seconds")
    if not 0 < raw <= max_s:
        raise ValueError(f"'{what}' must be more than 0 and at most {max_s:g} s")
    return float(raw)
