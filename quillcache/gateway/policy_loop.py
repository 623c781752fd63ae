"""The policy engine in the gateway: its targets, its decisions every `interval_s`, and
the warm requests that carry them out (docs/policy.md).

Pins come from the admin API (`admin.py`), session retention from requests' hints
(`openai_api.py`). Both are retention targets (`policy.targets`): the plane prefers
their holders when routing (`ControlPlane.pin`), and every tick the loop expires the
lapsed ones, measures each engine's rate of new blocks from the index's events, and sends
the warm requests `policy.retention.plan` finds due (`actuator.Warmer`), as tasks that
never hold up routing.

With shared state the fleet keeps the pins (Redis, `fleet.py`) and pins them in every
replica's plane; the replica that took a pin keeps its tokens and retains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quillcache.controlplane import ControlPlane
from quillcache.gateway.actuator import Warmer
from quillcache.gateway.config import PolicyConfig
from quillcache.gateway.session_hints import SessionHint
from quillcache.gateway.workers import WorkerPool
from quillcache.policy.retention import BlockRates, TouchTiming, Warm, plan
from quillcache.policy.targets import (
    KeyArray,
    Target,
    TargetBudgetError,
    TargetId,
    TargetKind,
    TargetStore,
)

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
        for state in self.plane.workers():
            self.rates.observe(state.worker, state.stored_blocks, now)
        if not len(self.store):
            return []
        due = plan(
            self.store,
            holders_of=self.plane.holders,
            interval_s=self._interval_s,
            place=self._place,
            now_s=now,
            min_interval_s=self.config.touch_min_interval_s,
        )
        for warm in due:
            self._send(warm)
        return due

    def _interval_s(self, engine: int) -> float:
        """Without the engine's capacity, what it holds (by the index): the same once it
        is full, less (touches sooner) while it is not."""
        state = self.plane.worker(engine)
        size = state.capacity_blocks or state.resident_blocks
        return self.timing.interval_s(size, self.rates.rate(engine))

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
        worker = self.pool.workers.get(warm.engine)
        if target is None or worker is None:
            return
        cached = 0
        n = len(target.keys)
        for m in self.plane.match(target.keys):
            if m.worker == warm.engine and m.medium == "GPU":
                cached = max(cached, min(m.blocks, n))
        task = asyncio.create_task(self.warmer.warm(worker, target, warm.action, cached))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        counts = {k: 0 for k in TargetKind}
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
        if stats.seconds:
            slowest = GaugeMetricFamily(
                "quillcache_policy_warm_seconds_max",
                "The longest of the last warm requests' durations",
            )
            slowest.add_metric([], max(stats.seconds))
            yield slowest


def ttl_of(raw: object, default_s: float, max_s: float, what: str = "ttl_s") -> float:
    """A TTL hint in seconds: `default_s` when absent; ValueError naming the limit."""
    if raw is None:
        return default_s
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        raise ValueError(f"'{what}' must be a number of seconds")
    if not 0 < raw <= max_s:
        raise ValueError(f"'{what}' must be more than 0 and at most {max_s:g} s")
    return float(raw)
