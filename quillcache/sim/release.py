"""Arrivals, open or closed loop.

A request without parents arrives at its `arrival_s` (open loop: the workload's
timestamps). A request with parents (a session's previous turn, an agent DAG's
planner or the calls a join gathers) is released the way a real client sends it:
when the last of its parents has finished, plus its own think / tool time
(`wait_s`). Its `arrival_s` in the workload is then only the open-loop time
(`Workload.open_loop()` replays that instead).

A parent the gateway rejected counts as finished when it was rejected (a client
learns of the failure then). Ties in time go in workload order, so a run is
deterministic.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import replace

from quillcache.errors import ConfigError
from quillcache.sim.requests import SimRequest


class Arrivals:
    """The next request to arrive, given what has finished so far."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self._requests = list(requests)
        pos = {r.rid: n for n, r in enumerate(self._requests)}
        if len(pos) != len(self._requests):
            raise ConfigError("the workload's request ids are not unique")
        self._pos = pos
        self._children: dict[int, list[int]] = {}
        self._waiting: dict[int, int] = {}  # position -> parents not finished yet
        self._ready_s: dict[int, float] = {}  # position -> latest parent finish so far
        self._heap: list[tuple[float, int]] = []  # (arrival, position)
        for n, r in enumerate(self._requests):
            parents = set(r.parents)
            if not parents:
                self._heap.append((r.arrival_s, n))
                continue
            missing = sorted(p for p in parents if p not in pos)
            if missing:
                raise ConfigError(f"request {r.rid} waits for unknown requests {missing}")
            if r.rid in parents:
                raise ConfigError(f"request {r.rid} waits for itself")
            if not (math.isfinite(r.wait_s) and r.wait_s >= 0):
                raise ConfigError(f"request {r.rid}: wait must be >= 0 s, got {r.wait_s}")
            self._waiting[n] = len(parents)
            for p in parents:
                self._children.setdefault(p, []).append(n)
        heapq.heapify(self._heap)
        self.released = 0

    def __bool__(self) -> bool:
        """Whether a request is still to arrive (released or waiting for parents)."""
        return bool(self._heap) or bool(self._waiting)

    def next_s(self) -> float:
        """When the next released request arrives (inf: none released now)."""
        return self._heap[0][0] if self._heap else math.inf

    def pop(self) -> SimRequest:
        """The next arrival; a closed-loop one carries its release time as `arrival_s`."""
        if not self._heap:
            stuck = sorted(self._requests[n].rid for n in self._waiting)[:5]
            raise ConfigError(
                f"{len(self._waiting)} requests wait for parents that never finish "
                f"(a dependency cycle?), e.g. {stuck}"
            )
        t, n = heapq.heappop(self._heap)
        self.released += 1
        r = self._requests[n]
        return r if t == r.arrival_s else replace(r, arrival_s=t)

    def finished(self, rid: int, at_s: float, now_s: float) -> None:
        """Request `rid` finished (or was rejected) at `at_s`, learned at `now_s`
        (>= `at_s`): release the children whose last parent it was, never before now."""
        for n in self._children.pop(rid, ()):
            ready = max(self._ready_s.get(n, -math.inf), at_s)
            left = self._waiting[n] - 1
            if left:
                self._waiting[n] = left
                self._ready_s[n] = ready
                continue
            del self._waiting[n]
            self._ready_s.pop(n, None)
            heapq.heappush(self._heap, (max(ready + self._requests[n].wait_s, now_s), n))
