"""Retention: when to touch a target's holders, and where to place a target nobody holds.

An engine's prefix cache evicts least-recently-used blocks first (vLLM's free block
queue, SGLang's radix-tree LRU), and a request that reuses a block moves it to the most
recently used end. A prefix stays cached as long as it is used more often than the
engine's cache turns over, so the policy touches it (a one-token request carrying it)
within a share (`safety`) of that turnover time. The turnover time comes from the
index's view of the engine: its capacity in blocks over the rate at which it stores new
ones (BlockStored events: every new block takes a free one, the least recently used
once the cache is full; counting stores rather than evictions is safe while the cache
still has room, and sees the pressure before the first eviction). An engine that
stores nothing is under no pressure: its holders are touched every `max_interval_s`.

A target held nowhere (never placed, or evicted before it was touched) is prefetched:
a pin onto the engine `place` names (the least loaded one serving its model), a session
onto its own engine, where its next turn is routed.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from quillcache.policy.targets import KeyArray, Target, TargetId, TargetKind

#: The touch timing's defaults (the gateway's `PolicyConfig`, the simulator's
#: `RetainSettings`): at most every 2 s, every 2 min under no pressure, within a
#: quarter of the LRU's turnover time.
TOUCH_MIN_INTERVAL_S = 2.0
TOUCH_MAX_INTERVAL_S = 120.0
TOUCH_SAFETY = 0.25
#: The share of an engine's KV capacity retention keeps at most (the rest is its LRU's).
MAX_ENGINE_SHARE = 0.5


class WarmAction(enum.Enum):
    RETAIN = "retain"  # touch a holder before its LRU evicts the prefix
    PREFETCH = "prefetch"  # place the prefix on an engine that does not hold it
    REPLICATE = "replicate"  # place a hot prefix on one more engine


@dataclass(frozen=True, slots=True)
class Warm:
    """Send `target`'s prefix to `engine` as a one-token request."""

    target: TargetId
    engine: int
    action: WarmAction


@dataclass(frozen=True, slots=True)
class TouchTiming:
    min_interval_s: float
    max_interval_s: float
    safety: float

    def interval_s(self, capacity_blocks: float, stores_per_s: float) -> float:
        """How often a holder with this capacity and rate of new blocks is touched."""
        if stores_per_s <= 0 or capacity_blocks <= 0:
            return self.max_interval_s
        turnover_s = capacity_blocks / stores_per_s
        return min(self.max_interval_s, max(self.min_interval_s, self.safety * turnover_s))


class BlockRates:
    """Each engine's rate of new blocks a second, from its cumulative stored-block count
    sampled over time (exponentially weighted over `half_life_s`)."""

    def __init__(self, half_life_s: float = 10.0) -> None:
        self.half_life_s = half_life_s
        self._last: dict[int, tuple[float, float]] = {}  # engine -> (count, at_s)
        self._rate: dict[int, float] = {}

    def observe(self, engine: int, total: float, now_s: float) -> None:
        last = self._last.get(engine)
        self._last[engine] = (total, now_s)
        if last is None or now_s <= last[1]:
            return
        count, at = last
        if total < count:  # the engine was removed and added again
            self._rate.pop(engine, None)
            return
        instant = (total - count) / (now_s - at)
        old = self._rate.get(engine)
        if old is None:
            self._rate[engine] = instant
            return
        keep = math.exp(-math.log(2) * (now_s - at) / self.half_life_s)
        self._rate[engine] = keep * old + (1 - keep) * instant

    def rate(self, engine: int) -> float:
        return self._rate.get(engine, 0.0)

    def forget(self, engine: int) -> None:
        self._last.pop(engine, None)
        self._rate.pop(engine, None)


def plan(
    targets: Iterable[Target],
    *,
    holders_of: Callable[[KeyArray], set[int]],
    computing_of: Callable[[KeyArray], set[int]],
    interval_s: Callable[[int], float],
    place: Callable[[Target], int | None],
    now_s: float,
    min_interval_s: float,
    room_blocks: Callable[[int], float] = lambda engine: math.inf,
) -> list[Warm]:
    """The warm requests due at `now_s`, in the targets' order.

    - A session is kept on its own engine only (its next turn is routed there); other
      holders of its prefix are left to their LRU.
    - A pin is kept on every holder (routing prefers them all).
    - A target whose engines hold none of it is prefetched (a pin onto `place(target)`,
      a session onto its engine), unless it was warmed there within `min_interval_s`
      (its events may not have arrived yet).
    - An engine on which a routed request is computing the whole prefix
      (`computing_of`: a session's turn still queued or in prefill) is neither touched
      nor prefetched: that request uses the prefix, and a queue longer than
      `min_interval_s` would otherwise have it computed twice.
    - An engine keeps at most `room_blocks(engine)` blocks of targets: pins first,
      then the sessions that expire last (their latest turns); the rest are left to
      its LRU. Without the bound, a router that puts many sessions on one engine has
      their touches fill its cache, every eviction then costs a prefetch of a whole
      prefix, and the budget goes on prefetches instead of cheap touches.
    """
    targets = list(targets)
    wanted: list[tuple[set[int], int | None]] = []  # per target: engines kept, placed onto
    for t in targets:
        computing = computing_of(t.keys)
        holders = holders_of(t.keys) - computing
        if t.kind is TargetKind.SESSION:
            if t.engine is None:
                wanted.append((set(), None))
                continue
            keep = holders & {t.engine}
        else:
            keep = holders
        onto = None
        if not keep and not (computing and (t.kind is TargetKind.PIN or t.engine in computing)):
            onto = t.engine if t.kind is TargetKind.SESSION else place(t)
        wanted.append((keep, onto))
    fits = _fitting(targets, wanted, room_blocks)
    out: list[Warm] = []
    for i, t in enumerate(targets):
        keep, onto = wanted[i]
        for engine in sorted(keep):
            if (i, engine) not in fits:
                continue
            if now_s - t.touched_s.get(engine, -math.inf) >= interval_s(engine):
                out.append(Warm(t.id, engine, WarmAction.RETAIN))
        if onto is None or (i, onto) not in fits:
            continue
        if now_s - t.touched_s.get(onto, -math.inf) >= min_interval_s:
            out.append(Warm(t.id, onto, WarmAction.PREFETCH))
    return out


def _fitting(
    targets: list[Target],
    wanted: list[tuple[set[int], int | None]],
    room_blocks: Callable[[int], float],
) -> set[tuple[int, int]]:
    """(target position, engine) for each target an engine has room to keep: pins
    first, then by expiry, the latest first (ties: the targets' order)."""
    order = sorted(
        range(len(targets)),
        key=lambda i: (targets[i].kind is not TargetKind.PIN, -targets[i].expires_s, i),
    )
    left: dict[int, float] = {}
    fits: set[tuple[int, int]] = set()
    for i in order:
        keep, onto = wanted[i]
        blocks = len(targets[i].keys)
        for engine in sorted(keep | ({onto} if onto is not None else set())):
            room = left[engine] if engine in left else room_blocks(engine)
            if blocks <= room:
                room -= blocks
                fits.add((i, engine))
            left[engine] = room
    return fits
