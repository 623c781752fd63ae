"""An engine's queue priced as the requests it holds (`CostModel.queue_time` with the
queued attention pairs), against the reference: the requests' own prefill compute,
one by one; and a plane's load store keeps the pairs of what it has queued."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from quillcache.controlplane.load import PAIRS, QUEUED, LocalLoadStore
from quillcache.costmodel import CostModel, CostModelConfig, prefill_pairs

COSTS = [
    CostModel(),
    CostModel(CostModelConfig().with_overrides({"engine.max_num_batched_tokens": 512})),
]
# (new tokens, cached context tokens) of each queued request
queue = st.lists(
    st.tuples(st.integers(1, 40_000), st.integers(0, 120_000)), min_size=1, max_size=20
)


@given(queue)
def test_queued_compute_is_the_sum_of_the_requests_prefill_compute(
    reqs: list[tuple[int, int]],
) -> None:
    tokens = sum(n for n, _ in reqs)
    pairs = sum(prefill_pairs(n, c) for n, c in reqs)
    for cost in COSTS:
        want = sum(cost.prefill_compute_s(n, c) for n, c in reqs)
        assert math.isclose(cost.queued_compute_s(tokens, pairs), want, rel_tol=1e-12)
        steps = -(-tokens // cost.chunk_budget)
        assert math.isclose(
            cost.queue_time(tokens, pairs), want + steps * cost.overhead_s, rel_tol=1e-12
        )


def test_several_prompts_are_not_one_and_a_long_context_counts() -> None:
    cost = COSTS[0]
    # 16 separate 6,000-token prompts: cheaper than one 96,000-token prompt
    sixteen = 16 * prefill_pairs(6_000, 0)
    one = prefill_pairs(96_000, 0)
    assert cost.queue_time(96_000, sixteen) < 0.5 * cost.queue_time(96_000, one)
    # 2,000 new tokens after 30,000 cached: dearer than 2,000 tokens alone
    assert cost.queue_time(2_000, prefill_pairs(2_000, 30_000)) > 1.5 * cost.queue_time(
        2_000, prefill_pairs(2_000, 0)
    )


@given(st.integers(0, 10**6), st.integers(0, 10**12), st.integers(0, 10**5), st.integers(0, 10**12))
def test_the_queue_time_never_falls_as_tokens_or_pairs_grow(
    q: int, p: int, dq: int, dp: int
) -> None:
    cost = COSTS[0]
    t = cost.queue_time(q, p)
    assert cost.queue_time(q + dq, p + dp) >= t
    # fewer pairs than tokens: each token attends at least to itself
    assert cost.queue_time(q, min(p, q)) == cost.queue_time(q, 0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["book", "prefill", "release"]),
        st.integers(1, 5000),
        st.integers(0, 50_000),
    ),
    max_size=60,
)


@given(ops)
def test_the_local_store_keeps_the_pairs_of_what_is_queued(
    script: list[tuple[str, int, int]],
) -> None:
    store = LocalLoadStore(rows=1)
    store.add(0)
    queued: list[tuple[int, int]] = []  # (prefill, prompt) of the requests still queued
    for op, n, c in script:
        if op == "book":
            store.book(0, n, n + c)
            queued.append((n, n + c))
        elif queued:
            n, prompt = queued.pop(0)
            if op == "prefill":
                store.prefilled(0, n, prompt)
            else:
                store.release(0, n, prompt, False)
        want = sum(prefill_pairs(n, prompt - n) for n, prompt in queued)
        assert store.value(0, PAIRS) == want
        assert store.value(0, QUEUED) == sum(n for n, _ in queued)
