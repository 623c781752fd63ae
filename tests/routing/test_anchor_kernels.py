"""The peer routers' native kernels compute, bit for bit, what their numpy reference
does: `dynamo_costs` = `DynamoKvCost.logits`, `llmd_scores` = `llm_d_scores`,
`sglang_pick` = `SglangCacheAware.candidates`, `best_positions` = numpy's
`flatnonzero` of the values near the best; on fleets with fractional loads, several
rows per engine, every tier and every knob."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache._native import best_positions
from quillcache._native import sglang_pick as native_sglang_pick
from quillcache.routing import Request, View
from quillcache.routing.dynamo import DynamoKvCost
from quillcache.routing.llmd import LlmdPrecisePrefix, llm_d_scores
from quillcache.routing.sglang import SglangCacheAware
from quillcache.routing.types import LOAD_FIELDS
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


@settings(max_examples=300)
@given(fleet=fleets(), data=st.data())
def test_sglang_kernel_is_the_numpy_choice(
    fleet: tuple[Request, View], data: st.DataObject
) -> None:
    _, view = fleet
    c = view.columns
    n = len(c.worker)
    # few distinct values: ties on every key the choice breaks them by
    resident = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    in_flight = data.draw(
        st.lists(st.sampled_from([0.0, 1.0, 2.5, 70.0, 200.0]), min_size=n, max_size=n)
    )
    load = c.load.copy()
    load[:, 0] = in_flight
    fleet_cols = np.zeros((n, 3))
    fleet_cols[:, 1] = resident
    view = View(
        None,
        view.block_size,
        view.cost,
        columns=dataclasses.replace(c, load=load, fleet=fleet_cols),
    )
    router = SglangCacheAware(
        balance_abs_threshold=data.draw(st.sampled_from([0, 1, 64])),
        balance_rel_threshold=data.draw(st.sampled_from([0.5, 1.0, 1.5])),
    )
    got = native_sglang_pick(
        np.ascontiguousarray(load),
        fleet_cols,
        c.worker,
        c.gpu_blocks,
        c.pending_blocks,
        float(router.balance_abs_threshold),
        float(router.balance_rel_threshold),
    )
    assert got == router.candidates(view)


def test_sglang_kernel_refuses_nan() -> None:
    load = np.zeros((2, len(LOAD_FIELDS)))
    load[1, 0] = np.nan
    ids = np.array([0, 1], dtype=np.uint64)
    zeros = np.zeros(2, dtype=np.int64)
    with pytest.raises(ValueError, match="not numbers"):
        native_sglang_pick(load, np.zeros((2, 3)), ids, zeros, zeros, 64.0, 1.5)


@settings(max_examples=300)
@given(
    values=st.lists(
        st.one_of(
            st.sampled_from([0.0, -0.0, 1.0, 1.0 + 1e-12, 2.5, np.inf, -np.inf]),
            st.floats(-1e6, 1e6),
        ),
        min_size=1,
        max_size=40,
    ),
    tolerance=st.sampled_from([0.0, 1e-12, 1e-9, 0.5]),
)
def test_best_positions_is_numpy(values: list[float], tolerance: float) -> None:
    v = np.asarray(values, dtype=np.float64)
    assert best_positions(v, tolerance) == np.flatnonzero(v <= v.min() + tolerance).tolist()
    assert (
        best_positions(v, tolerance, lowest=False)
        == np.flatnonzero(v >= v.max() - tolerance).tolist()
    )


def test_best_positions_refuses_nan_and_empty() -> None:
    with pytest.raises(ValueError, match="not a number"):
        best_positions(np.array([1.0, np.nan]))
    with pytest.raises(ValueError):
        best_positions(np.zeros(0))
