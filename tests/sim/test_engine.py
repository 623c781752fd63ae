"""The engine model against an independent reference, and its events against the index."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel
from quillcache.index import create_backend
from quillcache.sim.engine import EngineModel, Running, engine_hash
from quillcache.sim.requests import make_request
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import DEFAULT_MODEL, Workload, sim_namespace
from tests.sim.engine_ref import ReferenceCache

BS = 4
NS = sim_namespace(BS)
COST = CostModel()


@st.composite
def workloads(draw: st.DrawFn, max_requests: int = 40) -> list[tuple[list[int], int]]:
    """Prompts that share prefixes: a few base sequences cut at random lengths plus
    a random tail, over a tiny alphabet (so tails collide too)."""
    bases = [draw(st.lists(st.integers(300, 303), min_size=8, max_size=40)) for _ in range(3)]
    out = []
    for _ in range(draw(st.integers(1, max_requests))):
        base = bases[draw(st.integers(0, 2))]
        cut = draw(st.integers(0, len(base)))
        tail = draw(st.lists(st.integers(300, 303), max_size=12))
        prompt = base[:cut] + tail or [300]
        out.append((prompt, draw(st.integers(0, 9))))
    return out


def _requests(items: list[tuple[list[int], int]]) -> list:
    return [
        make_request(i, float(i), out, BS, NS, tokens=np.array(p, dtype=np.uint32))
        for i, (p, out) in enumerate(items)
    ]


def _resident(index, worker: int = 0, medium: str = "GPU") -> set[int]:
    return {
        e.key
        for e in index.entries()
        if any(h.worker == worker and h.medium == medium for h in e.holders)
    }


@settings(max_examples=120)
@given(items=workloads(), capacity=st.integers(16, 60))
def test_order_only_cache_matches_the_reference(items, capacity) -> None:
    reqs = _requests(items)
    engine = EngineModel(0, capacity_blocks=capacity, block_size=BS, cost=COST)
    ref = ReferenceCache(capacity, BS)
    index = create_backend("memory")
    index.register_source(0, model=DEFAULT_MODEL)
    for r in reqs:
        if engine.blocks_needed(r) > capacity:
            continue
        run_, payload = engine.serve_instantly(r)
        assert run_.hit_blocks == ref.serve(r.keys_list, r.prompt_tokens, r.output_tokens)
        if payload:
            stats = index.apply(0, [payload])
            assert stats.orphan_blocks == stats.invalid_events == stats.unknown_removals == 0
        # the index, fed only by events, knows exactly what the engine caches
        assert _resident(index) == set(ref.lru) == set(engine.free) | set(engine.refs)
        assert engine.in_use == 0 and len(engine.free) <= capacity


def _serve_general(engine: EngineModel, r) -> tuple[Running, bytes]:
    """`serve_instantly` through the general reference-counted path."""
    run_ = Running(r, r.keys_list, 0, 0, 0, 0, 0)
    assert engine._admit(run_, engine.blocks_needed(r))
    engine._store(run_, len(run_.keys))
    engine._finish(run_)
    return run_, engine.drain_events(r.arrival_s)


@settings(max_examples=80)
@given(items=workloads(), capacity=st.integers(16, 60))
def test_idle_fast_path_equals_the_general_path(items, capacity) -> None:
    fast = EngineModel(0, capacity_blocks=capacity, block_size=BS, cost=COST)
    general = EngineModel(0, capacity_blocks=capacity, block_size=BS, cost=COST)
    for r in _requests(items):
        if fast.blocks_needed(r) > capacity:
            continue
        run_a, payload_a = fast.serve_instantly(r)
        run_b, payload_b = _serve_general(general, r)
        assert payload_a == payload_b  # same events, same order, same bytes
        assert run_a.hit_blocks == run_b.hit_blocks
        assert list(fast.free) == list(general.free)  # same LRU order
        assert fast.evictions == general.evictions and not fast.refs


@settings(max_examples=60)
@given(items=workloads(max_requests=25), capacity=st.integers(16, 40), cpu=st.integers(1, 30))
def test_cpu_tier_events_mirror_the_engine(items, capacity, cpu) -> None:
    reqs = _requests(items)
    engine = EngineModel(0, capacity_blocks=capacity, block_size=BS, cost=COST, cpu_blocks=cpu)
    index = create_backend("native")
    index.register_source(0, model=DEFAULT_MODEL)
    for r in reqs:
        if engine.blocks_needed(r) > capacity:
            continue
        gpu_before, cpu_before = engine.prefix_hit(r.keys_list)
        run_, payload = engine.serve_instantly(r)
        last_full = max((r.prompt_tokens - 1) // BS, 0)
        # CPU hits can shrink when the room made for the request pushes them out of a
        # small tier, GPU hits cannot
        assert min(gpu_before, last_full) <= run_.hit_blocks
        assert run_.hit_blocks <= min(gpu_before + cpu_before, last_full)
        if payload:
            index.apply(0, [payload])
        assert _resident(index) == set(engine.free) | set(engine.refs)
        assert _resident(index, medium="CPU") == set(engine.cpu)
        assert len(engine.cpu) <= cpu


def test_pinned_prefix_survives_pressure() -> None:
    pinned = make_request(0, 0.0, 0, BS, NS, tokens=np.arange(300, 316, dtype=np.uint32))
    engine = EngineModel(0, capacity_blocks=10, block_size=BS, cost=COST)
    engine.pin(pinned)
    for i in range(50):
        toks = np.arange(1000 + 40 * i, 1000 + 40 * i + 20, dtype=np.uint32)
        engine.serve_instantly(make_request(i + 1, 0.0, 0, BS, NS, tokens=toks))
    assert set(pinned.keys_list) <= set(engine.refs)
    again = make_request(99, 0.0, 0, BS, NS, tokens=np.arange(300, 321, dtype=np.uint32))
    run_, _ = engine.serve_instantly(again)
    assert run_.hit_blocks == 4


def test_engine_hash_is_opaque_and_collision_free() -> None:
    keys = list(range(10_000))
    hashes = {engine_hash(k, 77) for k in keys}
    assert len(hashes) == len(keys) and not hashes & set(keys[1:])


@settings(max_examples=40, deadline=None)
@given(items=workloads(max_requests=30), capacity=st.integers(16, 40), workers=st.integers(1, 3))
def test_timed_run_invariants(items, capacity, workers) -> None:
    reqs = _requests(items)
    wl = Workload("t", reqs, BS)
    res = run(
        wl, "quillcache", "memory", SimConfig(workers=workers, capacity_blocks=capacity), COST
    )
    for rec in res.records:
        if rec.rejected:
            assert "capacity" in rec.rejected
            continue
        assert rec.arrival_s < rec.first_token_s <= rec.finish_s
        assert 0 <= rec.hit_blocks <= max((rec.prompt_tokens - 1) // BS, 0)
    served = [r for r in res.records if not r.rejected]
    assert len(served) == sum(
        1 for r in reqs if -(-(r.prompt_tokens + r.output_tokens) // BS) <= capacity
    )


def test_one_request_ttft_is_its_prefill_step() -> None:
    toks = np.arange(300, 300 + 4000, dtype=np.uint32)
    r = make_request(0, 1.0, 10, BS, NS, tokens=toks)
    res = run(Workload("one", [r], BS), "random", "memory", SimConfig(workers=1), COST)
    rec = res.records[0]
    assert rec.first_token_s - rec.arrival_s == pytest.approx(
        COST.step_time(COST.prefill_compute_s(4000, 0), 0, 0)
    )
    decode = COST.decode_step_time(1, 4001)
    assert rec.finish_s - rec.first_token_s == pytest.approx(9 * decode, rel=0.05)


def test_abort_frees_everything_but_the_cached_blocks() -> None:
    engine = EngineModel(0, capacity_blocks=50, block_size=BS, cost=COST)
    toks = np.arange(300, 340, dtype=np.uint32)  # 10 full blocks
    waiting = engine.enqueue(make_request(0, 0.0, 8, BS, NS, tokens=toks))
    engine.abort(waiting)
    assert not engine.has_work() and engine.queued_prefill_tokens == 0
    run_ = engine.enqueue(make_request(1, 0.0, 8, BS, NS, tokens=toks))
    step_s, k, chunks, decoders = engine.plan_step()
    assert engine.in_use == 12  # (40 prompt + 8 output tokens) / 4 reserved
    engine.apply_step(step_s, k, chunks, decoders, step_s)  # prefill done, decoding
    engine.abort(run_)
    assert not engine.has_work() and engine.in_use == 0 and engine.queued_prefill_tokens == 0
    assert len(engine.free) == 10  # the computed prompt blocks stay cached
