"""Closed-loop arrivals: a session's next turn and an agent DAG's children are sent when
their parents have finished plus their think / tool time, never before."""

from __future__ import annotations

import heapq
import json
import math
import subprocess
import sys
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.generators import agent_fanout, multi_turn
from quillcache.sim.metrics import Record
from quillcache.sim.release import Arrivals
from quillcache.sim.requests import SimRequest
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import Workload

COST = CostModel()
EPS = 1e-9


def _req(rid: int, arrival: float, parents: tuple[int, ...] = (), wait: float = 0.0) -> SimRequest:
    return SimRequest(
        rid=rid,
        arrival_s=arrival,
        prompt_tokens=16,
        output_tokens=1,
        keys=np.zeros(0, dtype=np.uint64),
        block_size=16,
        parents=parents,
        wait_s=wait,
    )


@st.composite
def _dags(draw: st.DrawFn) -> tuple[list[SimRequest], list[float]]:
    n = draw(st.integers(1, 30))
    times = st.floats(0, 50, allow_nan=False)
    reqs = []
    for i in range(n):
        parents = tuple(draw(st.sets(st.integers(0, i - 1), max_size=3))) if i else ()
        reqs.append(_req(i, draw(times), parents, draw(times) if parents else 0.0))
    service = [draw(st.floats(0, 20, allow_nan=False)) for _ in range(n)]
    return reqs, service


@given(_dags(), st.randoms(use_true_random=False))
def test_release_times_match_the_recursive_definition(dag, rnd) -> None:
    """Every request served at once for its own service time: the arrival `Arrivals`
    gives equals release(i) = max over parents (release(p) + service(p)) + wait(i)."""
    reqs, service = dag
    want: list[float] = []
    for r in reqs:  # parents come first: a reference by recursion
        if r.parents:
            want.append(max(want[p] + service[p] for p in r.parents) + r.wait_s)
        else:
            want.append(r.arrival_s)
    shuffled = list(reqs)
    rnd.shuffle(shuffled)  # the workload's list order does not matter
    arrivals = Arrivals(shuffled)
    done: list[tuple[float, int]] = []
    got: dict[int, float] = {}
    while arrivals or done:
        if done and done[0][0] <= arrivals.next_s():
            t, rid = heapq.heappop(done)
            arrivals.finished(rid, t, t)
            continue
        r = arrivals.pop()
        got[r.rid] = r.arrival_s
        heapq.heappush(done, (r.arrival_s + service[r.rid], r.rid))
    assert [got[i] for i in range(len(reqs))] == pytest.approx(want)


def test_a_cycle_or_an_unknown_parent_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown requests"):
        Arrivals([_req(0, 0.0, (5,))])
    with pytest.raises(ConfigError, match="itself"):
        Arrivals([_req(0, 0.0, (0,))])
    cycle = Arrivals([_req(0, 0.0, (1,)), _req(1, 0.0, (0,))])
    assert cycle
    with pytest.raises(ConfigError, match="never finish"):
        cycle.pop()


def _violations(wl: Workload, records: list[Record]) -> list[int]:
    """Requests that arrived before their last parent finished plus their wait."""
    by_rid = {rec.rid: rec for rec in records}
    bad = []
    for r in wl.requests:
        if not r.parents:
            continue
        finish = max(by_rid[p].finish_s for p in r.parents)
        if by_rid[r.rid].arrival_s < finish + r.wait_s - EPS:
            bad.append(r.rid)
    return bad


def _workload(kind: str, seed: int, size: int, closed_loop: bool = True) -> Workload:
    if kind == "multi-turn":
        return multi_turn(
            sessions=size,
            turns=4,
            system_prompt_len=256,
            rate=20.0,
            think_time_s=0.5,
            seed=seed,
            closed_loop=closed_loop,
        )
    return agent_fanout(
        tasks=size,
        fanout=4,
        context_len=512,
        rate=4.0,
        step_delay_s=0.2,
        seed=seed,
        closed_loop=closed_loop,
    )


@settings(max_examples=12, deadline=None)
@given(
    kind=st.sampled_from(["multi-turn", "agent-fanout"]),
    seed=st.integers(0, 2**16),
    size=st.integers(2, 10),
    router=st.sampled_from(["round-robin", "quillcache", "session-affinity", "dynamo"]),
    timing=st.sampled_from(["full", "none"]),
)
def test_no_child_arrives_before_its_parents_finish_plus_its_wait(
    kind: str, seed: int, size: int, router: str, timing: str
) -> None:
    wl = _workload(kind, seed, size)
    assert wl.closed_loop
    config = SimConfig(workers=2, capacity_blocks=4096, timing=timing)  # type: ignore[arg-type]
    res = run(wl, router, "native", config, COST)
    assert {rec.rid for rec in res.records} == {r.rid for r in wl.requests}
    assert not [rec.rid for rec in res.records if rec.rejected]
    assert _violations(wl, res.records) == []
    # children of a finished parent are released at exactly finish + wait (when that
    # is not inside a step that had already begun: order-only has no steps)
    if timing == "none":
        by_rid = {rec.rid: rec for rec in res.records}
        for r in wl.requests:
            if r.parents:
                finish = max(by_rid[p].finish_s for p in r.parents)
                assert by_rid[r.rid].arrival_s == pytest.approx(finish + r.wait_s)
    again = run(wl, router, "native", config, COST)  # same seed, same result
    assert again.records == res.records


def test_open_loop_sends_children_before_their_parents_finish_under_load() -> None:
    """The property above can fail: replayed open loop, the same workload sends calls
    while their planner still runs (what the closed loop fixes)."""
    wl = _workload("agent-fanout", 1, 10)
    config = SimConfig(workers=2, capacity_blocks=4096)
    closed = run(wl, "round-robin", "native", config, COST)
    assert _violations(wl, closed.records) == []
    opened = run(wl.open_loop(), "round-robin", "native", config, COST)
    assert _violations(wl, opened.records)  # judged against the closed-loop parents
    assert not wl.open_loop().closed_loop
    unrolled = _workload("agent-fanout", 1, 10, closed_loop=False)
    assert [r.arrival_s for r in unrolled.requests] == [r.arrival_s for r in wl.requests]
    assert [r.keys_list for r in unrolled.requests] == [r.keys_list for r in wl.requests]


def test_generators_name_their_parents() -> None:
    mt = multi_turn(sessions=3, turns=4, system_prompt_len=50)
    for r in mt.requests:
        same = [q for q in mt.requests if q.session_id == r.session_id]
        k = same.index(r)
        assert r.parents == ((same[k - 1].rid,) if k else ())
        assert (r.wait_s > 0) == bool(k)
    af = agent_fanout(tasks=2, fanout=3, context_len=64, step_delay_s=1.5)
    for task in ("task-0", "task-1"):
        planner, *calls, join = [q for q in af.requests if q.session_id == task]
        assert planner.parents == ()
        assert all(c.parents == (planner.rid,) and c.wait_s == 1.5 for c in calls)
        assert sorted(join.parents) == [c.rid for c in calls] and join.wait_s == 1.5


def test_time_scale_and_engine_blocks_keep_the_dependencies() -> None:
    wl = _workload("agent-fanout", 0, 3)
    fast = wl.scaled(0.5)
    assert [r.parents for r in fast.requests] == [r.parents for r in wl.requests]
    assert [r.wait_s for r in fast.requests] == [r.wait_s * 0.5 for r in wl.requests]
    fine = wl.with_engine_blocks(8)
    assert [(r.parents, r.wait_s) for r in fine.requests] == [
        (r.parents, r.wait_s) for r in wl.requests
    ]
    assert math.isclose(fine.requests[-1].wait_s, 0.2)


def _simulate(*args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", *args, "--json", "-", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def test_cli_open_loop_and_no_session_ids() -> None:
    small = ["--workload", "multi-turn", "--gen", "sessions=12", "--gen", "turns=3"]
    small += ["--routers", "session-affinity,round-robin", "--jobs", "1"]
    closed = _simulate(*small)
    opened = _simulate(*small, "--open-loop")
    bare = _simulate(*small, "--no-session-ids")
    unhinted = _simulate(*small, "--no-session-ids", "--no-parent-hints")
    assert unhinted["meta"]["workload_params"]["parent_hints"] is False
    assert "parent_hints" not in bare["meta"]["workload_params"]
    assert closed["meta"]["workload_params"]["closed_loop"] is True
    assert opened["meta"]["workload_params"]["closed_loop"] is False
    assert bare["meta"]["workload_params"]["session_ids"] is False
    by = {
        name: {r["router"]: r for r in run["results"]}
        for name, run in (("closed", closed), ("open", opened), ("bare", bare))
    }
    # arrivals differ between the loops; the session hint matters to session affinity only
    assert by["closed"]["round-robin"]["ttft_mean_s"] != by["open"]["round-robin"]["ttft_mean_s"]
    assert by["bare"]["round-robin"] == by["closed"]["round-robin"]
    assert by["bare"]["session-affinity"] != by["closed"]["session-affinity"]


def _rooted_sessions(wl: Workload) -> Workload:
    """The reference for parent hints: no hints, and every request that follows another
    in the session of its root (the first request of its chain of first parents);
    roots in none."""
    by_rid = {r.rid: r for r in wl.requests}

    def root(r: SimRequest) -> int:
        while r.parents:
            r = by_rid[r.parents[0]]
        return r.rid

    reqs = [replace(r, session_id=f"dag-{root(r)}" if r.parents else None) for r in wl.requests]
    return replace(wl, requests=reqs).without_parent_hints()


@settings(max_examples=8, deadline=None)
@given(
    kind=st.sampled_from(["multi-turn", "agent-fanout"]),
    seed=st.integers(0, 2**16),
    size=st.integers(2, 10),
)
def test_a_parent_hint_places_a_request_in_the_session_its_root_s_first_child_opened(
    kind: str, seed: int, size: int
) -> None:
    """Without session ids, `quillcache` routes with parent hints exactly as it routes
    the same workload whose requests that follow another carry their root's session
    id (the root itself none): request for request, the same engine and times."""
    wl = _workload(kind, seed, size).without_sessions()
    assert wl.parent_hints
    config = SimConfig(workers=3, capacity_blocks=4096)
    hinted = run(wl, "quillcache", "native", config, COST)
    reference = run(_rooted_sessions(wl), "quillcache", "native", config, COST)
    assert hinted.records == reference.records


def test_the_parent_hint_changes_quillcache_s_routing_and_no_other_s() -> None:
    """The hint is read: without it (`--no-parent-hints`) `quillcache` places this
    workload otherwise, and a router that does not read it places it the same."""
    wl = _workload("multi-turn", 3, 10).without_sessions()
    config = SimConfig(workers=3, capacity_blocks=4096)
    for router, differs in (("quillcache", True), ("mooncake", False)):
        hinted = run(wl, router, "native", config, COST)
        bare = run(wl.without_parent_hints(), router, "native", config, COST)
        assert (hinted.records != bare.records) == differs, router
