"""The SLO queue in the timed simulator (the gateway's `slo_admission: queue`,
`gateway/slo_queue.py`).

A request the admission stage refuses while waiting could help (its TTFT miss is queue
time on the chosen engine: `SloMiss.waiting_helps`) waits here instead of being
refused. At the first event (an arrival or an engine's step end) at least `tick_s` after
the last round, every waiter is routed again, in arrival order, against what is left
of its TTFT SLO (the time it has waited taken off); the first engine that can meet it
takes it, and one whose estimate says no wait can help any more refuses it. Beyond
`max_waiting` waiters a refused request is refused at once. The simulator's requests
carry no priority: the order is their arrival (the gateway's order within one
priority).
"""

from __future__ import annotations

from collections import deque

from quillcache.routing import SLO
from quillcache.sim.requests import SimRequest


class SloWaiters:
    def __init__(self, slo: SLO, max_waiting: int, tick_s: float) -> None:
        assert slo.ttft_s is not None
        self.slo = slo
        self.max_waiting = max_waiting
        self.tick_s = tick_s
        self._waiting: deque[tuple[SimRequest, float]] = deque()  # (request, since)
        self._round: dict[int, float] = {}  # this round's waiters: rid -> since
        self._next_s = 0.0
        self.waited = 0  # requests that waited at least once
        self.most = 0  # waiters at once, at most

    def stats(self) -> dict[str, int]:
        """What the run's summary reports (`RunResult.policy`)."""
        return {"slo_waited": self.waited, "slo_waiting_most": self.most}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, req: SimRequest, now_s: float) -> bool:
        """`req`, refused at `now_s`, waits; False when the queue is full."""
        if len(self._waiting) >= self.max_waiting:
            return False
        if not self._waiting:
            self._next_s = now_s + self.tick_s
        self._waiting.append((req, now_s))
        self.waited += 1
        self.most = max(self.most, len(self._waiting))
        return True

    def due(self, now_s: float) -> bool:
        return bool(self._waiting) and now_s >= self._next_s

    def take(self, now_s: float) -> list[tuple[SimRequest, SLO]]:
        """This round's waiters, in order, each with what is left of its SLO; the
        queue is empty until `keep` puts back those still waiting."""
        self._next_s = now_s + self.tick_s
        out = []
        self._round = {}
        assert self.slo.ttft_s is not None
        for req, since in self._waiting:
            self._round[req.rid] = since
            left = SLO(ttft_s=self.slo.ttft_s - (now_s - since), tbt_s=self.slo.tbt_s)
            out.append((req, left))
        self._waiting = deque()
        return out

    def keep(self, req: SimRequest) -> None:
        """`req` still waits (after this round's others that were kept before it)."""
        self._waiting.append((req, self._round[req.rid]))
