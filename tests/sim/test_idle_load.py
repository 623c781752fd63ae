"""An engine that goes idle reports its empty load: a router reading the load of an
engine whose last request finished sees nothing in flight there."""

from __future__ import annotations

import numpy as np

from quillcache.costmodel import CostModel
from quillcache.routing import Decision, Request, Router, View
from quillcache.sim.requests import make_request
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import DEFAULT_MODEL, Workload, sim_namespace

BS = 16


class _Watching(Router):
    """Worker 0 always; records the in-flight count the view showed per worker."""

    name = "watching"

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[float]] = []

    def route(self, request: Request, view: View) -> Decision:
        self.seen.append(view.columns.in_flight.tolist())
        return self.decide(request, view, view.worker_at(0))


def test_an_idle_engine_shows_nothing_in_flight() -> None:
    """Requests 10 s apart, each done in well under a second: every one finds both
    engines empty (without the idle report, the engine's last report, made when its
    last step began, keeps counting the request that step finished)."""
    ns = sim_namespace(BS, DEFAULT_MODEL)
    reqs = [
        make_request(
            i, i * 10.0, 8, BS, ns, tokens=np.arange(i * 100, i * 100 + 64, dtype=np.uint32)
        )
        for i in range(6)
    ]
    router = _Watching()
    result = run(Workload("idle", reqs, BS), router, "native", SimConfig(workers=2), CostModel())
    assert all(r.first_token_s >= 0 for r in result.records)
    assert router.seen == [[0.0, 0.0]] * 6
