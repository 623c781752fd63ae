"""Engine blocks finer than a trace's block ids (`Workload.with_engine_blocks`).

The coarse run (engine block = trace block) is the reference: with ample capacity a
finer engine finds the same prefix hits, in tokens, except inside the first trace
block that misses, which a finer engine may hit in part; under pressure its hits,
capacity, events and index all count engine blocks.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.metrics import RunResult
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.trace import load_trace
from quillcache.sim.workload import Workload
from tests.sim.test_cli import _sim
from tests.sim.trace_fixture import write_chained_trace

TRACE_BS = 32
UNBOUNDED = 1 << 31
COST = CostModel()


@st.composite
def chained_records(draw: st.DrawFn, *, aligned: bool) -> list[dict]:
    """Requests along the paths of a random tree of block ids (so the ids are chained:
    an id always follows the same parent). `aligned`: every prompt ends one token into
    its last block, so no trace block is ever cached in part."""
    nodes = draw(st.integers(1, 14))
    parent = [draw(st.integers(-1, i - 1)) for i in range(nodes)]
    picks = draw(st.lists(st.integers(0, nodes - 1), min_size=1, max_size=24))
    records = []
    for t, node in enumerate(picks):
        path = []
        while node >= 0:
            path.append(node + 1)
            node = parent[node]
        path.reverse()
        tail = 1 if aligned else draw(st.integers(1, TRACE_BS))
        records.append(
            {
                "timestamp": t * 100,
                "input_length": (len(path) - 1) * TRACE_BS + tail,
                "output_length": draw(st.integers(1, 40)),
                "hash_ids": path,
            }
        )
    return records


def _load(records: list[dict]) -> Workload:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return load_trace(path, block_size=TRACE_BS)


def _one_worker(wl: Workload, capacity_blocks: int) -> RunResult:
    return run(wl, "round-robin", "native", SimConfig(1, capacity_blocks, timing="none"), COST)


def _hit_tokens(res: RunResult) -> list[int]:
    return [rec.hit_blocks * res.block_size for rec in res.records]


@settings(max_examples=60, deadline=None)
@given(records=chained_records(aligned=True), k=st.sampled_from([2, 4, 8, 16]))
def test_ample_capacity_finer_blocks_hit_the_same_tokens(records: list[dict], k: int) -> None:
    coarse_wl = _load(records)
    fine_wl = coarse_wl.with_engine_blocks(TRACE_BS // k)
    assert fine_wl.block_size == TRACE_BS // k
    coarse = _one_worker(coarse_wl, UNBOUNDED)
    fine = _one_worker(fine_wl, UNBOUNDED)
    assert _hit_tokens(fine) == _hit_tokens(coarse)
    # the index and the events count engine blocks: k per cached trace block
    assert fine.index_blocks == k * coarse.index_blocks
    assert fine.summary()["prefill_tokens_saved"] == coarse.summary()["prefill_tokens_saved"]


@settings(max_examples=60, deadline=None)
@given(records=chained_records(aligned=False), k=st.sampled_from([2, 4, 8, 32]))
def test_ample_capacity_finer_blocks_differ_only_inside_the_first_missed_trace_block(
    records: list[dict], k: int
) -> None:
    coarse = _one_worker(_load(records), UNBOUNDED)
    fine = _one_worker(_load(records).with_engine_blocks(TRACE_BS // k), UNBOUNDED)
    for c, f in zip(_hit_tokens(coarse), _hit_tokens(fine), strict=True):
        assert c <= f < c + TRACE_BS
        assert f // TRACE_BS * TRACE_BS == c


@settings(max_examples=60, deadline=None)
@given(
    records=chained_records(aligned=False),
    k=st.sampled_from([2, 4, 8]),
    capacity=st.integers(4, 12),
)
def test_under_pressure_finer_blocks_count_engine_blocks(
    records: list[dict], k: int, capacity: int
) -> None:
    fine_wl = _load(records).with_engine_blocks(TRACE_BS // k)
    fine_capacity = capacity * k  # the same memory as `capacity` trace blocks
    pressed = _one_worker(fine_wl, fine_capacity)
    ample = _one_worker(fine_wl, UNBOUNDED)
    # one worker: the bounded cache only ever holds blocks the unbounded one holds
    for p, a in zip(_hit_tokens(pressed), _hit_tokens(ample), strict=True):
        assert p <= a
    # the index mirrors the engine block by block: never more than it can hold
    assert pressed.index_blocks <= fine_capacity
    assert pressed.capacity_blocks == fine_capacity


def test_finer_eviction_keeps_part_of_a_trace_block(tmp_path: Path) -> None:
    """LRU evicts a finished request's tail first: a finer engine loses one engine
    block of it where the coarse one loses a whole trace block, so the next hit ends
    inside a trace block."""
    a = {"input_length": 3 * TRACE_BS + 1, "output_length": 1, "hash_ids": [1, 2, 3, 4]}
    c = {"input_length": 2 * TRACE_BS + 1, "output_length": 1, "hash_ids": [10, 11, 12]}
    records = [{**r, "timestamp": t * 100} for t, r in enumerate([a, c, a])]
    coarse = _one_worker(_load(records), 5)
    fine = _one_worker(_load(records).with_engine_blocks(8), 5 * 4)
    assert _hit_tokens(coarse) == [0, 0, 2 * TRACE_BS]
    assert _hit_tokens(fine) == [0, 0, 3 * TRACE_BS - 8]


def test_generated_workloads_are_keyed_again_from_their_tokens() -> None:
    from quillcache.sim.generators import GENERATORS

    wl = GENERATORS["multi-turn"](seed=3, block_size=32)
    fine = wl.with_engine_blocks(8)
    coarse_res = _one_worker(wl, UNBOUNDED)
    fine_res = _one_worker(fine, UNBOUNDED)
    for c, f in zip(_hit_tokens(coarse_res), _hit_tokens(fine_res), strict=True):
        assert c <= f < c + 32
    assert sum(_hit_tokens(fine_res)) > 0


@pytest.mark.parametrize("engine_bs", [48, 1024, 0])
def test_block_sizes_that_do_not_divide_the_trace_are_refused(engine_bs: int) -> None:
    wl = _load([{"timestamp": 0, "input_length": 70, "output_length": 1, "hash_ids": [1, 2, 3]}])
    with pytest.raises(ConfigError) as err:
        wl.with_engine_blocks(engine_bs)
    msg = str(err.value)
    assert f"engine.block_size {engine_bs}" in msg and str(TRACE_BS) in msg
    assert "would work: 1, 2, 4, 8, 16, 32" in msg


def test_cli_models_a_finer_engine_and_refuses_a_misfit(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    write_chained_trace(trace, sessions=12)
    common = ["--trace", str(trace), "--routers", "round-robin", "--jobs", "1"]
    default = json.loads(_sim(*common, "--no-progress", "--json", "-").stdout)
    fine = json.loads(
        _sim(*common, "--cost", "engine.block_size=64", "--no-progress", "--json", "-").stdout
    )
    assert default["meta"]["block_size"] == 512
    assert fine["meta"]["block_size"] == 64
    assert fine["meta"]["cost_model"]["engine"]["block_size"] == 64
    assert fine["meta"]["workload_params"]["engine_block_size"] == 64
    # the cost model's capacity, in engine blocks: the same memory in 8x the blocks
    want = CostModel().kv_capacity_blocks(64)
    assert fine["results"][0]["capacity_blocks"] == want
    assert default["results"][0]["capacity_blocks"] == CostModel().kv_capacity_blocks(512)
    saved_fine = fine["results"][0]["prefill_tokens_saved"]
    assert saved_fine >= default["results"][0]["prefill_tokens_saved"] > 0

    proc = _sim(*common, "--cost", "engine.block_size=96", "--no-progress", check=False)
    assert proc.returncode == 2
    flat = " ".join(proc.stderr.split())
    assert "engine.block_size 96" in flat and "512" in flat and "would work:" in flat
    assert "Traceback" not in proc.stderr
