"""`quillcache simulate --dp-ranks K --dp-placement gateway|engine` (quillcache/sim/dp.py)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.routing import Decision, Request, Router, View
from quillcache.sim.dp import EnginePlacement, RankLoad
from quillcache.sim.requests import make_request
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import DEFAULT_MODEL, Workload, sim_namespace

BS = 16
COST = CostModel()


def _workload(prompts: list[int], *, spacing_s: float = 1.0, output: int = 4) -> Workload:
    """Request i's prompt is 4 full blocks + 1 token of the token range named by
    prompts[i]: equal numbers, equal prompts."""
    reqs = [
        make_request(
            i,
            i * spacing_s,
            output,
            BS,
            sim_namespace(BS, DEFAULT_MODEL),
            tokens=np.arange(p * 1000, p * 1000 + 4 * BS + 1, dtype=np.uint32),
        )
        for i, p in enumerate(prompts)
    ]
    return Workload("dp-test", reqs, BS)


class _Scripted(Router):
    """Worker 0, rank `ranks[i]` for request i; records what the view showed of each
    (worker, rank)'s local prefix."""

    name = "scripted"

    def __init__(self, ranks: list[int | None]) -> None:
        super().__init__()
        self.ranks = ranks
        self.seen: list[dict[tuple[int, int], int]] = []

    def route(self, request: Request, view: View) -> Decision:
        self.seen.append({(w.worker, w.dp_rank): w.local_blocks for w in view.workers})
        i = int(request.request_id)
        return Decision(worker=0, dp_rank=self.ranks[i])


def _run(router: Router | str, wl: Workload, **config: Any) -> Any:
    return run(wl, router, "native", SimConfig(**config), COST)


@pytest.mark.parametrize("timing", ["none", "full"])
def test_one_rank_is_placement_blind(timing: str) -> None:
    """With K=1 there is no rank to place: both placements give the same run (the JSON
    of a K=1 run is byte-identical to the code before ranks: see the commit message)."""
    wl = _workload([i % 3 for i in range(30)], spacing_s=0.05)
    a = _run("quillcache", wl, workers=2, timing=timing, capacity_blocks=64)
    b = _run("quillcache", wl, workers=2, timing=timing, capacity_blocks=64, dp_placement="engine")
    assert a.summary() == b.summary()
    assert [r.hit_blocks for r in a.records] == [r.hit_blocks for r in b.records]


@pytest.mark.parametrize("timing", ["none", "full"])
def test_each_rank_has_its_own_cache_and_events(timing: str) -> None:
    # prompt 5 on rank 1, then on rank 0 (a miss: rank 1's cache is not rank 0's), then
    # on rank 1 again (a hit)
    router = _Scripted([1, 0, 1])
    res = _run(router, _workload([5, 5, 5]), workers=2, dp_ranks=2, timing=timing)
    assert [r.hit_blocks for r in res.records] == [0, 0, 4]
    # the index learnt rank 1's blocks under rank 1 only, then rank 0's under rank 0
    assert router.seen[1][(0, 1)] == 4 and router.seen[1][(0, 0)] == 0
    assert router.seen[2][(0, 0)] == 4 and router.seen[2][(0, 1)] == 4
    assert all(seen[(1, 0)] == seen[(1, 1)] == 0 for seen in router.seen)


def test_engine_placement_ignores_the_decisions_rank() -> None:
    # the gateway always names rank 1; vLLM's balancer spreads idle ranks round-robin
    wl = _workload([1, 2, 3, 4])
    gateway = _Scripted([1, 1, 1, 1])
    _run(gateway, wl, workers=1, dp_ranks=2, timing="none")
    assert all(seen[(0, 0)] == 0 for seen in gateway.seen)
    engine = _Scripted([1, 1, 1, 1])
    res = _run(
        engine,
        _workload([1, 2, 1, 2]),
        workers=1,
        dp_ranks=2,
        timing="none",
        dp_placement="engine",
        load_window=1,
    )
    # with each rank's load proxy 0 or 1, requests alternate ranks 0, 1, 0, 1: the
    # repeated prompts land where they were computed
    assert [r.hit_blocks for r in res.records] == [0, 0, 4, 4]
    assert engine.seen[2][(0, 0)] == 4 and engine.seen[2][(0, 1)] == 0


def _reference_choice(start: int, loads: list[RankLoad]) -> int:
    def score(load: RankLoad) -> float:
        penalty = load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5) if load.waiting else 0.0
        return load.waiting + load.running + penalty

    n = len(loads)
    order = [(start + i) % n for i in range(n)]
    return min(order, key=lambda idx: (score(loads[idx]), order.index(idx)))


@given(
    st.lists(
        st.lists(
            st.builds(
                RankLoad,
                st.integers(0, 6),
                st.integers(0, 6),
                st.sampled_from([0.0, 0.3, 0.5, 0.75, 1.0]),
            ),
            min_size=3,
            max_size=3,
        ),
        min_size=1,
        max_size=12,
    )
)
def test_engine_rule_matches_vllms(rounds: list[list[RankLoad]]) -> None:
    """vLLM's get_core_engine_for_request: lowest score, first from a start index that
    advances by one per request."""
    placement = EnginePlacement(workers=1, ranks=3)
    for i, loads in enumerate(rounds):
        assert placement.choose(0, loads) == _reference_choice(i % 3, loads)


def test_bad_values_are_config_errors() -> None:
    wl = _workload([1])
    with pytest.raises(ConfigError, match="dp ranks must be >= 1"):
        _run("round-robin", wl, dp_ranks=0)
    with pytest.raises(ConfigError, match="dp placement"):
        _run("round-robin", wl, dp_placement="coordinator")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--dp-ranks", "0"], "dp ranks must be >= 1"),
        (["--dp-placement", "random"], "dp placement must be one of gateway, engine"),
        (["--dp-ranks", "2", "--replicas", "2"], "one gateway only"),
    ],
)
def test_cli_bad_values_exit_2(args: list[str], message: str) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "quillcache",
            "simulate",
            "--requests",
            "10",
            "--no-progress",
            "--routers",
            "round-robin",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
