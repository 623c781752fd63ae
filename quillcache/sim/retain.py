"""Session retention in the timed simulator (`quillcache.policy.retention`).

A request with a session id carries a retention hint (`RetainSettings.session_ttl_s`,
what `x-session-ttl` or `nvext.session_control` give a request online): its prompt, on
the engine that serves it, becomes the session's target until the TTL after its last
turn, pinned in the control plane as the gateway pins it (the session's next turn is
routed to its engine while that engine has room). At the first event at least
`period_s` after the last check, the targets past their TTL go, each engine's rate of
new blocks is read from the index (`BlockRates`, the BlockStored events the plane
counts), and `retention.plan` names the touches due: a session's engine is touched
within `touch_safety` of the time its LRU takes to turn over, and a session whose
prefix its engine no longer holds is prefetched there. Each is executed as the real
actuator would: a request carrying the prefix and one output token, queued on the
engine, within the per-engine and per-tenant prefill budgets (`ActuationBudget`). It
hits the cached blocks, which moves them to the young end of the engine's free queue,
or computes them again. Its prefill tokens are the policy's cost, reported beside the
requests' own.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from quillcache.controlplane import ControlPlane
from quillcache.errors import ConfigError
from quillcache.policy.budget import (
    BURST_S,
    ENGINE_TOKENS_PER_S,
    TENANT_TOKENS_PER_S,
    ActuationBudget,
)
from quillcache.policy.retention import (
    MAX_ENGINE_SHARE,
    TOUCH_MAX_INTERVAL_S,
    TOUCH_MIN_INTERVAL_S,
    TOUCH_SAFETY,
    BlockRates,
    TouchTiming,
    WarmAction,
    plan,
)
from quillcache.policy.targets import (
    RETENTION_MAX_TOKENS,
    SESSION_MAX_TTL_S,
    Target,
    TargetBudgetError,
    TargetId,
    TargetKind,
    TargetStore,
)
from quillcache.sim.engine import EngineModel, Running
from quillcache.sim.options import numeric_options
from quillcache.sim.replicate import prefix_request
from quillcache.sim.requests import SimRequest

#: Touch requests' ids are at or below this (replicas' are below -(1 << 40)).
TOUCH_RID_BASE = -(1 << 50)

#: The simulator's requests have no tenant: one namespace, one budget.
TENANT = ""


@dataclass(frozen=True)
class RetainSettings:
    """The simulator's retention knobs: the TTL every session asks for, how often the
    policy decides, and the gateway's touch timing, store bound and budgets
    (`PolicyConfig`: the same defaults, from `quillcache.policy`)."""

    session_ttl_s: float = 300.0
    period_s: float = 0.5
    touch_min_interval_s: float = TOUCH_MIN_INTERVAL_S
    touch_max_interval_s: float = TOUCH_MAX_INTERVAL_S
    touch_safety: float = TOUCH_SAFETY
    max_engine_share: float = MAX_ENGINE_SHARE
    max_tokens: int = RETENTION_MAX_TOKENS
    engine_tokens_per_s: float = ENGINE_TOKENS_PER_S
    tenant_tokens_per_s: float = TENANT_TOKENS_PER_S
    budget_burst_s: float = BURST_S

    @classmethod
    def parse(cls, options: dict[str, Any]) -> RetainSettings:
        """From KEY=VALUE options (`--retain-opt`, a grid cell's `retain`)."""
        ints = frozenset({"max_tokens"})
        s = cls(**numeric_options(cls, options, what="retention", ints=ints))
        s.check()
        return s

    def check(self) -> None:
        if not 0 < self.session_ttl_s <= SESSION_MAX_TTL_S:
            raise ConfigError(
                f"retention session_ttl_s must be in (0, {SESSION_MAX_TTL_S:g}] s (the gateway's "
                f"session_max_ttl_s), got {self.session_ttl_s}"
            )
        for name in ("period_s", "touch_min_interval_s", "touch_max_interval_s", "budget_burst_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"retention {name} must be positive, got {getattr(self, name)}")
        if self.touch_min_interval_s > self.touch_max_interval_s:
            raise ConfigError("retention touch_min_interval_s must not exceed touch_max_interval_s")
        for name in ("touch_safety", "max_engine_share"):
            if not 0 < getattr(self, name) <= 1:
                raise ConfigError(f"retention {name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("max_tokens", "engine_tokens_per_s", "tenant_tokens_per_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"retention {name} must be >= 0, got {getattr(self, name)}")

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class Retainer:
    """The session targets, the policy's decisions and the touch requests of one timed
    run behind one gateway (`plane`)."""

    def __init__(
        self, settings: RetainSettings, engines: list[EngineModel], plane: ControlPlane
    ) -> None:
        self.settings = settings
        self.engines = engines
        self.plane = plane
        self.store = TargetStore(max_tokens=settings.max_tokens, pin_budget_tokens=0)
        self.rates = BlockRates()
        self.timing = TouchTiming(
            settings.touch_min_interval_s, settings.touch_max_interval_s, settings.touch_safety
        )
        self.budget = ActuationBudget(
            engine_rate=settings.engine_tokens_per_s,
            tenant_rate=settings.tenant_tokens_per_s,
            burst_s=settings.budget_burst_s,
        )
        self._next_s = 0.0
        self._rids = itertools.count()
        self._source: dict[TargetId, SimRequest] = {}  # the turn whose prompt is kept
        self.touches = 0
        self.prefetches = 0
        self.over_budget = 0  # touches due that the budget held back
        self.dropped = 0  # session turns the store had no room for
        self.prefill_tokens = 0  # computed by finished touch requests

    @staticmethod
    def is_touch(rid: int) -> bool:
        return TOUCH_RID_BASE - (1 << 40) < rid <= TOUCH_RID_BASE

    def turn(self, req: SimRequest, engine: int, now_s: float) -> None:
        """A session's request went to `engine`: its prompt's full blocks become the
        session's target there (`PolicyEngine.session_turn` online)."""
        if req.session_id is None or not len(req.keys):
            return
        bs = req.block_size
        tokens = req.tokens
        # the store counts a target's tokens; a trace row has block ids, not tokens,
        # and only their number matters here (the touch request is built from `req`)
        token_ids = (
            tokens[: len(req.keys) * bs].tolist()
            if tokens is not None
            else np.zeros(len(req.keys) * bs, dtype=np.uint32).tolist()
        )
        target = Target(
            kind=TargetKind.SESSION,
            tenant=TENANT,
            name=req.session_id,
            keys=req.keys,
            token_ids=token_ids,
            model="",
            salt=None,
            expires_s=now_s + self.settings.session_ttl_s,
            engine=engine,
        )
        try:
            old = self.store.put(target)
        except TargetBudgetError:
            self.dropped += 1
            return
        self.plane.pin(target.keys, engine)
        if old is not None:
            self.plane.unpin(old.keys)
            target.touched_s = {e: s for e, s in old.touched_s.items() if e == engine}
        target.touched_s[engine] = now_s  # the turn itself used the prefix there
        self._source[target.id] = req

    def due(self, now_s: float) -> bool:
        return now_s >= self._next_s

    def tick(self, now_s: float) -> list[tuple[int, SimRequest]]:
        """The touch (and prefetch) requests to queue now, with their engines."""
        self._next_s = now_s + self.settings.period_s
        for gone in self.store.expire(now_s):
            self.plane.unpin(gone.keys)
            self._source.pop(gone.id, None)
        for state in self.plane.workers():
            self.rates.observe(state.worker, state.stored_blocks, now_s)
        if not len(self.store):
            return []
        due = plan(
            self.store,
            holders_of=self.plane.holders,
            computing_of=self.plane.computing,
            room_blocks=self._room_blocks,
            interval_s=self._interval_s,
            place=lambda _target: None,  # sessions go to their own engine
            now_s=now_s,
            min_interval_s=self.settings.touch_min_interval_s,
        )
        out = []
        for warm in due:
            target = self.store.get(warm.target)
            src = self._source.get(warm.target)
            if target is None or src is None:
                continue
            req = prefix_request(src, len(target.keys), self._next_rid(), now_s)
            engine = self.engines[warm.engine]
            cached, _ = engine.prefix_hit(req.keys_list)
            cost = max(req.prompt_tokens - cached * req.block_size, 1)
            if not self.budget.take(warm.engine, TENANT, cost, now_s):
                self.over_budget += 1
                continue
            if not engine.fits_ever(req):
                continue
            target.touched_s[warm.engine] = now_s
            if warm.action is WarmAction.PREFETCH:
                self.prefetches += 1
            else:
                self.touches += 1
            out.append((warm.engine, req))
        return out

    def _next_rid(self) -> int:
        return TOUCH_RID_BASE - next(self._rids)

    def _room_blocks(self, engine: int) -> float:
        """As the gateway's: its share of the engine's capacity."""
        return self.settings.max_engine_share * self.plane.worker(engine).capacity_blocks

    def _interval_s(self, engine: int) -> float:
        """As the gateway's: the engine's capacity (else what it holds, by the index)
        over its rate of new blocks."""
        state = self.plane.worker(engine)
        size = state.capacity_blocks or state.resident_blocks
        return self.timing.interval_s(size, self.rates.rate(engine))

    def finished(self, run: Running) -> None:
        """Count a finished touch request's prefill (prompt minus its cached prefix)."""
        self.prefill_tokens += run.req.prompt_tokens - run.hit_blocks * run.req.block_size

    def stats(self) -> dict[str, Any]:
        """What the run's summary reports (`RunResult.policy`)."""
        return {
            "retention_touches": self.touches,
            "retention_prefetches": self.prefetches,
            "retention_over_budget": self.over_budget,
            "retention_dropped": self.dropped,
            "retention_prefill_tokens": self.prefill_tokens,
        }
