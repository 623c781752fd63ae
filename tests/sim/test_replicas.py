"""The simulator's gateway replicas (`quillcache.sim.replicas`, issue 16 §3)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.routing import Decision, Request, Router, View
from quillcache.sim.generators import GENERATORS
from quillcache.sim.replicas import (
    BookRouter,
    LoadBalancer,
    ReplicaConfig,
    SpeculativeBook,
)
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import Workload

_REPLICA_KEYS = ("replicas", "replica_state", "lb", "routing_precision")


def _workload(requests: int = 240, seed: int = 0) -> Workload:
    # loaded enough that queues form: load and speculation matter to the routers
    return GENERATORS["shared-prefix"](
        requests=requests,
        prefix_groups=6,
        shared_prefix_blocks=24,
        unique_blocks=4,
        output_tokens=64,
        rate=60.0,
        seed=seed,
        block_size=16,
    )


def _cost(bs: int = 16) -> CostModel:
    from quillcache.costmodel import CostModelConfig

    return CostModel(CostModelConfig().with_overrides({"engine.block_size": bs}))


def _run(
    workload: Workload,
    router: str,
    replicas: ReplicaConfig | None,
    *,
    timing: str = "full",
    workers: int = 4,
    capacity: int | None = 400,
) -> tuple[dict[str, Any], list[Any]]:
    config = SimConfig(workers=workers, capacity_blocks=capacity, timing=timing)  # type: ignore[arg-type]
    res = run(workload, router, "native", config, _cost(workload.block_size), replicas=replicas)
    return res.summary(), [asdict(r) for r in res.records]


@pytest.mark.parametrize("state", ["shared", "private"])
@pytest.mark.parametrize("router", ["quillcache", "llm-d", "random", "round-robin", "preble"])
@pytest.mark.parametrize("lb", ["round-robin", "random"])
def test_one_replica_is_the_plain_simulator(state: str, router: str, lb: str) -> None:
    """With one replica, shared and private state both know everything one gateway
    knows: every request's worker, hit and timings are the plain run's, and the shadow
    agrees with every decision."""
    wl = _workload()
    plain, plain_recs = _run(wl, router, None)
    one, one_recs = _run(wl, router, ReplicaConfig(1, state, lb))
    assert one_recs == plain_recs
    assert one["routing_precision"] == 1.0
    assert {k: v for k, v in one.items() if k not in _REPLICA_KEYS} == plain


@pytest.mark.parametrize("state", ["shared", "private"])
def test_one_replica_order_only_is_the_plain_simulator(state: str) -> None:
    wl = _workload()
    plain, plain_recs = _run(wl, "quillcache", None, timing="none")
    one, one_recs = _run(wl, "quillcache", ReplicaConfig(1, state), timing="none")
    assert one_recs == plain_recs
    assert one["routing_precision"] == 1.0
    assert {k: v for k, v in one.items() if k not in _REPLICA_KEYS} == plain


def test_shared_state_decides_like_one_gateway_and_approximate_does_not() -> None:
    """4 replicas, round-robin LB, QuillCache's policy: with shared state nearly every
    decision is the shadow's; replicas that learn residency from their own quarter of
    the traffic disagree far more often, and private state lies in between."""
    wl = _workload(requests=400)
    precision = {}
    for state in ("shared", "private", "approximate"):
        summary, _ = _run(wl, "quillcache", ReplicaConfig(4, state))
        precision[state] = summary["routing_precision"]
    assert precision["shared"] >= 0.9, precision
    assert precision["approximate"] < precision["shared"] - 0.2, precision
    assert precision["approximate"] <= precision["private"] <= precision["shared"], precision


def test_replica_runs_are_deterministic() -> None:
    wl = _workload(requests=150)
    for state in ("shared", "private", "approximate"):
        cfg = ReplicaConfig(3, state, "random")
        assert _run(wl, "quillcache", cfg) == _run(wl, "quillcache", cfg)


def test_approximate_replicas_ingest_no_engine_events_but_learn_residency() -> None:
    """The approximate replica's index holds only what it routed (it never sees the
    engines' evictions); it still finds prefixes, so cache-aware routing keeps a hit
    rate well above round-robin's."""
    # more prefixes than the caches hold: where a prefix goes decides the hit rate
    wl = GENERATORS["shared-prefix"](
        requests=300,
        prefix_groups=24,
        shared_prefix_blocks=24,
        unique_blocks=4,
        output_tokens=64,
        rate=60.0,
        seed=0,
        block_size=16,
    )
    cfg = ReplicaConfig(2, "approximate")
    approx, _ = _run(wl, "quillcache", cfg, timing="none", capacity=200)
    rr, _ = _run(wl, "round-robin", cfg, timing="none", capacity=200)
    assert approx["index_blocks"] > 0
    assert approx["events_applied"] > 0  # its own learned events, not the engines'
    assert approx["block_hit_rate"] > rr["block_hit_rate"] + 0.2


@pytest.mark.parametrize(
    "config, needle",
    [
        (ReplicaConfig(0), "--replicas must be from 1 to 1024"),
        (ReplicaConfig(-3), "--replicas must be from 1 to 1024"),
        (ReplicaConfig(100_000), "--replicas must be from 1 to 1024, got 100000"),
        (ReplicaConfig(2, "psychic"), "unknown replica state 'psychic'"),
        (ReplicaConfig(2, "shared", "least-busy"), "unknown load balancer 'least-busy'"),
        (ReplicaConfig(2, "shared", "random", 0.0), "scrape interval must be positive"),
    ],
)
def test_bad_replica_options_are_config_errors(config: ReplicaConfig, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        config.check()
    with pytest.raises(ConfigError, match=needle):
        _run(_workload(requests=5), "random", config)


def test_load_balancers() -> None:
    rr = LoadBalancer("round-robin", 3, seed=0)
    assert [rr.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r1, r2 = LoadBalancer("random", 4, seed=5), LoadBalancer("random", 4, seed=5)
    seq = [r1.pick() for _ in range(400)]
    assert seq == [r2.pick() for _ in range(400)]
    assert set(seq) == {0, 1, 2, 3}
    assert seq != [LoadBalancer("random", 4, seed=6).pick() for _ in range(400)]


# --- the shared speculative book against the plane's own speculation ---------------


class _Fixed(Router):
    """Routes to the worker it is told, and remembers the pending column it saw."""

    name = "fixed"

    def __init__(self) -> None:
        super().__init__()
        self.to = 0
        self.seen: list[list[int]] = []

    def route(self, request: Request, view: View) -> Decision:
        self.seen.append(view.columns.pending_blocks.tolist())
        return Decision(worker=self.to)


_op = st.one_of(
    st.tuples(st.just("route"), st.integers(0, 7), st.integers(0, 2), st.integers(1, 6)),
    st.tuples(st.just("prefill"), st.integers(0, 7)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("wait"), st.floats(0.0, 40.0)),
    st.tuples(st.just("look"), st.integers(1, 6)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_op, max_size=40))
def test_speculative_book_is_the_planes_own_rule(ops: list[tuple[Any, ...]]) -> None:
    """Any interleaving of routes (ids reused), prefill_done, finish, time passing
    (TTL 60 s) and lookups: a plane without speculation reading a `SpeculativeBook`
    shows every router the same pending column as a plane that speculates itself."""
    ref_router, book_router = _Fixed(), _Fixed()
    ref = ControlPlane(index="native", router=ref_router, block_size=16, speculative=True)
    book = SpeculativeBook(ttl_s=60.0)
    plane = ControlPlane(
        index="native", router=BookRouter(book_router, book), block_size=16, speculative=False
    )
    for p in (ref, plane):
        for w in range(3):
            p.add_worker(w, capacity_blocks=100)
    prefix = np.arange(1, 7, dtype=np.uint64) * 7919  # requests share a chained prefix
    now = 0.0
    for op in ops:
        kind = op[0]
        if kind == "route" or kind == "look":
            rid, worker, n = (op[1], op[2], op[3]) if kind == "route" else (-1, 0, op[1])
            req = Request(request_id=rid, content_keys=prefix[:n], prompt_tokens=16 * n)
            ref_router.to = book_router.to = worker
            ref.route(req, now)
            plane.route(req, now)
            if kind == "route":
                book.add(req, worker, now)
            else:  # a lookup places nothing
                ref.finish(rid)
        elif kind == "prefill":
            ref.prefill_done(op[1])
            book.prefill_done(op[1])
        elif kind == "finish":
            ref.finish(op[1])
            book.finish(op[1])
        else:
            now += op[1]
        assert ref_router.seen == book_router.seen


# --- the command line -----------------------------------------------------------------


def test_cli_replica_sweep_json(tmp_path: Any) -> None:
    from tests.sim.test_cli import SMALL, _sim

    out = tmp_path / "r.json"
    _sim(
        *SMALL,
        "--routers",
        "quillcache,round-robin",
        "--replicas",
        "1,2",
        "--replica-state",
        "shared,approximate",
        "--lb",
        "random",
        "--json",
        str(out),
    )
    import json

    data = json.loads(out.read_text())
    assert data["meta"]["replicas"] == {"lb": "random", "scrape_interval_s": 1.0}
    got = {(r["router"], r["replicas"], r["replica_state"]) for r in data["results"]}
    assert got == {
        (router, n, state)
        for router in ("quillcache", "round-robin")
        for n in (1, 2)
        for state in ("shared", "approximate")
    }
    for r in data["results"]:
        assert 0.0 <= r["routing_precision"] <= 1.0 and r["lb"] == "random"


def test_cli_without_replicas_has_no_replica_fields() -> None:
    import json

    from tests.sim.test_cli import SMALL, _sim

    data = json.loads(_sim(*SMALL, "--routers", "random", "--json", "-").stdout)
    assert "replicas" not in data["meta"]
    assert not set(_REPLICA_KEYS) & set(data["results"][0])


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--replicas", "0"], "--replicas must be from 1 to 1024, got 0"),
        (["--replicas", "100000"], "--replicas must be from 1 to 1024, got 100000"),
        (["--replicas", "2,2"], "--replicas 2,2: a value is listed twice"),
        (["--replicas", "2", "--replica-state", "shared,shared"], "a value is listed twice"),
        (["--replicas", "two"], "is not a whole number"),
        (["--replicas", "2", "--replica-state", "gossip"], "unknown replica state 'gossip'"),
        (["--replicas", "2", "--lb", "hash"], "unknown load balancer 'hash'"),
        (["--replica-state", "shared"], "--replica-state needs --replicas"),
        (["--lb", "random"], "--lb needs --replicas"),
    ],
)
def test_cli_bad_replica_flags_exit_2(args: list[str], needle: str) -> None:
    from tests.sim.test_cli import SMALL, _sim

    proc = _sim(*SMALL, "--routers", "random", *args, check=False)
    assert proc.returncode == 2
    assert needle in " ".join(proc.stderr.split())
