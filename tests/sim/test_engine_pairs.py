"""The simulated engine's queued attention pairs (`EngineModel.queued_prefill_pairs`),
kept as requests queue, are admitted, compute chunks and are aborted, against the sum
recomputed from its queues after every step."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig, prefill_pairs
from quillcache.sim.engine import EngineModel
from quillcache.sim.requests import SimRequest

BS = 16
# a small step budget and few slots: requests wait, chunk and share steps
COST = CostModel(
    CostModelConfig().with_overrides(
        {"engine.max_num_batched_tokens": 256, "engine.max_num_seqs": 3}
    )
)


def recomputed(eng: EngineModel) -> float:
    total = 0.0
    for r in eng.waiting:
        new = max(r.req.prompt_tokens - r.hit_blocks * BS, 1)
        total += prefill_pairs(new, r.req.prompt_tokens - new)
    for r in eng.running:
        left = r.req.prompt_tokens - r.computed
        if left > 0:
            total += prefill_pairs(left, r.computed)
    return total


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 40), st.integers(0, 15), st.booleans()),
        min_size=1,
        max_size=25,
    )
)
def test_the_queued_pairs_are_the_queues_own(reqs: list[tuple[int, int, int, bool]]) -> None:
    eng = EngineModel(0, capacity_blocks=120, block_size=BS, cost=COST)
    runs = []
    now = 0.0
    for rid, (family, blocks, extra, abort) in enumerate(reqs):
        # requests of one family share their first blocks: some hit what others cached
        keys = np.asarray([family * 1_000 + b + 1 for b in range(blocks)], dtype=np.uint64)
        ids = keys.tolist()
        req = SimRequest(rid, now, blocks * BS + extra, 2, keys, BS, block_ids=ids, keys_list=ids)
        runs.append((eng.enqueue(req), abort))
        assert eng.queued_prefill_pairs() == recomputed(eng)
        if eng.has_work():
            step_s, k, chunks, decoders = eng.plan_step()
            now += step_s * k
            eng.apply_step(now, k, chunks, decoders, step_s)
        assert eng.queued_prefill_pairs() == recomputed(eng)
        run, abort = runs[len(runs) // 2]
        if abort and (run in eng.waiting or run in eng.running):
            eng.abort(run)
            assert eng.queued_prefill_pairs() == recomputed(eng)
    while eng.has_work():
        step_s, k, chunks, decoders = eng.plan_step()
        now += step_s * k
        eng.apply_step(now, k, chunks, decoders, step_s)
        assert eng.queued_prefill_pairs() == recomputed(eng)
    assert eng.queued_prefill_pairs() == 0.0
