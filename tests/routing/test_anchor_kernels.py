"""The peer routers' native kernels compute, bit for bit, what their numpy reference
does: `dynamo_costs` = `DynamoKvCost.logits`, `llmd_scores` = `llm_d_scores`; on
fleets with fractional loads, several rows per engine, every tier and every knob."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.routing import Request, View
from quillcache.routing.dynamo import DynamoKvCost
from quillcache.routing.llmd import LlmdPrecisePrefix, llm_d_scores
from tests.routing.test_kernels import fleets

weights = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0, 1))
scales = st.one_of(st.sampled_from([0.0, 1.0, 2.0]), st.floats(0, 50))


def with_capacity(fleet: tuple[Request, View], data: st.DataObject) -> tuple[Request, View]:
    request, view = fleet
    c = view.columns
    n = len(c.worker)
    capacity = data.draw(st.lists(st.integers(0, 100_000), min_size=n, max_size=n))
    fleet_cols = np.zeros((n, 3))
    fleet_cols[:, 0] = capacity
    columns = dataclasses.replace(c, fleet=fleet_cols)
    return request, View(None, view.block_size, view.cost, columns=columns)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype == np.float64 and a.tobytes() == b.tobytes()


@settings(max_examples=300)
@given(fleet=fleets(), data=st.data())
def test_dynamo_kernel_is_the_numpy_cost(fleet: tuple[Request, View], data: st.DataObject) -> None:
    request, view = with_capacity(fleet, data)
    router = DynamoKvCost(
        overlap_score_credit=data.draw(weights),
        host_cache_hit_weight=data.draw(weights),
        disk_cache_hit_weight=data.draw(weights),
        prefill_load_scale=data.draw(scales),
        overlap_score_credit_decay=data.draw(st.sampled_from([0.0, 0.1, 1.0, 7.5])),
        active_request_weight=data.draw(scales),
    )
    assert same_bits(router.costs(request, view), router.logits(request, view))


@settings(max_examples=300)
@given(fleet=fleets(), data=st.data())
def test_llmd_kernel_is_the_numpy_score(fleet: tuple[Request, View], data: st.DataObject) -> None:
    _, view = with_capacity(fleet, data)
    wp, wq, wk, tg, tc = (data.draw(scales) for _ in range(5))
    router = LlmdPrecisePrefix(
        prefix_weight=wp, queue_weight=wq, kv_weight=wk, gpu_tier_weight=tg, cpu_tier_weight=tc
    )
    want = llm_d_scores(view, (wp, wq, wk), (tg, tc))
    assert same_bits(router.scores(view), want)
