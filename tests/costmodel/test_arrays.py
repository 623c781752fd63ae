"""The cost model over columns is its scalar self per element, bit for bit: the routers
that score a fleet at once choose what a loop over the workers would."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig, prefill_pairs

COSTS = [
    CostModel(),
    CostModel(CostModelConfig().with_overrides({"engine.max_num_batched_tokens": 512})),
]
counts = st.lists(st.integers(-3, 400_000), min_size=1, max_size=30)
loads = st.lists(
    st.one_of(st.integers(0, 300), st.floats(0, 300, allow_nan=False)), min_size=1, max_size=30
)


def same(got: np.ndarray, want: list[float]) -> None:
    assert got.tolist() == want  # exact: no tolerance


@given(new=counts, data=st.data())
def test_prefill_and_queue_times(new: list[int], data: st.DataObject) -> None:
    ctx = data.draw(st.lists(st.integers(0, 200_000), min_size=len(new), max_size=len(new)))
    for cost in COSTS:
        n, c = np.asarray(new, dtype=np.int64), np.asarray(ctx, dtype=np.float64)
        same(
            cost.prefill_compute_s_array(n, c),
            [cost.prefill_compute_s(a, b) for a, b in zip(new, ctx, strict=True)],
        )
        same(
            cost.prefill_time_array(n, c),
            [cost.prefill_time(a, b) for a, b in zip(new, ctx, strict=True)],
        )
        pairs = prefill_pairs(n.astype(np.float64), c)
        same(
            cost.queue_time_array(n.astype(np.float64), pairs),
            [cost.queue_time(a, p) for a, p in zip(new, pairs.tolist(), strict=True)],
        )
        for tier in ("cpu", "disk", "peer"):
            same(cost.transfer_time_array(n, tier), [cost.transfer_time(a, tier) for a in new])


@given(queued=counts, data=st.data())
def test_loaded_prefill_and_decode_step_times(queued: list[int], data: st.DataObject) -> None:
    k = len(queued)
    new = data.draw(st.lists(st.integers(-2, 100_000), min_size=k, max_size=k))
    ctx = data.draw(st.lists(st.integers(0, 100_000), min_size=k, max_size=k))
    decodes = data.draw(st.lists(st.integers(0, 600), min_size=k, max_size=k))
    mean = data.draw(st.lists(st.floats(0, 40_000, allow_nan=False), min_size=k, max_size=k))
    pairs = data.draw(st.lists(st.integers(0, 10**12), min_size=k, max_size=k))
    for cost in COSTS:
        got = cost.loaded_prefill_time_array(
            queued_tokens=np.asarray(queued, dtype=np.float64),
            queued_pairs=np.asarray(pairs, dtype=np.float64),
            new_tokens=np.asarray(new, dtype=np.int64),
            context_tokens=np.asarray(ctx, dtype=np.int64),
            running_decodes=np.asarray(decodes, dtype=np.float64),
            mean_context_tokens=np.asarray(mean),
        )
        want = [
            cost.loaded_prefill_time(
                queued_tokens=q,
                queued_pairs=a,
                new_tokens=n,
                context_tokens=c,
                running_decodes=d,
                mean_context_tokens=m,
            )
            for q, a, n, c, d, m in zip(queued, pairs, new, ctx, decodes, mean, strict=True)
        ]
        same(got, want)
        got_step = cost.decode_step_time_array(
            np.asarray(decodes, dtype=np.float64), np.asarray(mean)
        )
        same(got_step, [cost.decode_step_time(d, m) for d, m in zip(decodes, mean, strict=True)])


@given(values=loads)
def test_fractional_loads_too(values: list[float]) -> None:
    cost = COSTS[0]
    v = np.asarray(values, dtype=np.float64)
    same(cost.queue_time_array(v, v * 3.5), [cost.queue_time(x, x * 3.5) for x in values])
    same(cost.decode_step_time_array(v, v), [cost.decode_step_time(x, x) for x in values])
