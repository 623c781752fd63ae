"""`dynamo` against Dynamo's KV router cost, one term at a time.

Each expected value is worked out by hand from Dynamo's formula
(lib/kv-router/src/scheduling/selector/default.rs, `worker_logit`; defaults from
lib/kv-router/src/scheduling/config.rs), for a request of 20 full blocks and 325
tokens at block size 16 (20.3125 blocks of prompt):

    logit = prefill_load_scale * max((active_prefill + isl)/bs - overlap_credit, 0)
            + active_blocks + (request blocks not shared with them)
            + active_request_weight * active_requests
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest

from quillcache.errors import ConfigError
from quillcache.routing import DynamoKvCost, Request, View, WorkerView, create_router
from quillcache.routing.dynamo import softmax_weights
from tests.routing.strategies import BLOCK, COST

PROMPT = 20 * BLOCK + 5  # 20 full blocks, 20.3125 blocks of tokens


def _req() -> Request:
    return Request(1, np.arange(1, 21, dtype=np.uint64), PROMPT)


def _logits(*workers: WorkerView, **options: float) -> list[float]:
    router = create_router("dynamo", **options)
    assert isinstance(router, DynamoKvCost)
    return router.logits(_req(), View(list(workers), BLOCK, COST)).tolist()


def test_defaults_are_dynamos() -> None:
    r = create_router("dynamo")
    assert isinstance(r, DynamoKvCost)
    # config.rs: overlap_score_credit 1.0, host_cache_hit_weight 0.75,
    # disk_cache_hit_weight 0.25, prefill_load_scale 1.0, overlap_score_credit_decay 0.0,
    # decode_active_request_weight 0.0, router_temperature 0.0
    assert (
        r.overlap_score_credit,
        r.host_cache_hit_weight,
        r.disk_cache_hit_weight,
        r.prefill_load_scale,
        r.overlap_score_credit_decay,
        r.active_request_weight,
        r.temperature,
    ) == (1.0, 0.75, 0.25, 1.0, 0.0, 0.0, 0.0)


def test_device_overlap_credit_and_prefill_load_scale() -> None:
    cached = WorkerView(
        0, gpu_blocks=15, queued_prefill_tokens=10 * BLOCK, kv_usage=0.5, capacity_blocks=100
    )
    idle = WorkerView(1, kv_usage=0.2, capacity_blocks=100)
    # cached: raw (160 + 325)/16 = 30.3125, credit 15 -> 15.3125; active 50 + 5 new = 55
    # idle: raw 20.3125, no credit; active 20 + 20 new = 40
    assert _logits(cached, idle) == [70.3125, 60.3125]
    # the scale multiplies the prefill part after the credit
    assert _logits(cached, idle, prefill_load_scale=2.0) == [85.625, 80.625]
    # a credit of 0.5 counts each cached block as half: 30.3125 - 7.5 = 22.8125
    assert _logits(cached, idle, overlap_score_credit=0.5) == [77.8125, 60.3125]
    # credit 0: pure load balancing on prefill, cached blocks still not new active blocks
    assert _logits(cached, idle, overlap_score_credit=0.0) == [85.3125, 60.3125]


def test_host_and_disk_hits_are_credited_below_the_device() -> None:
    tiered = WorkerView(0, gpu_blocks=4, cpu_blocks=10, disk_blocks=16)
    # host beyond the device 6, disk beyond both 6: 4 + 0.75*6 + 0.25*6 = 10
    # raw 20.3125 - 10 = 10.3125; active 0 + (20 - 4 on the device) = 16
    assert _logits(tiered) == [26.3125]
    assert _logits(tiered, host_cache_hit_weight=0.0, disk_cache_hit_weight=1.0) == [
        (20.3125 - (4 + 6)) + 16
    ]


def test_potential_active_blocks_count_the_request_where_it_is_not_active() -> None:
    # a prefix an in-flight request is computing there is shared with an active
    # sequence: only the rest of the request adds active blocks
    computing = WorkerView(0, gpu_blocks=4, pending_blocks=12, kv_usage=0.1, capacity_blocks=200)
    elsewhere = WorkerView(1, gpu_blocks=4, kv_usage=0.1, capacity_blocks=200)
    # prefill: 20.3125 - 4 = 16.3125 on both; active 20 + (20 - 12) = 28 vs 20 + 16 = 36
    assert _logits(computing, elsewhere) == [44.3125, 52.3125]


def test_overlap_credit_decay_with_prefill_backlog() -> None:
    busy = WorkerView(0, gpu_blocks=15, queued_prefill_tokens=40 * BLOCK)
    floor = WorkerView(1, queued_prefill_tokens=0)
    # request blocks ceil(325/16) = 21; busy's backlog above the floor 40 blocks = 40/21
    # requests; credit 1/(1 + 1.0 * 40/21) = 21/61
    credit = 1.0 / (1.0 + 40 / 21)
    busy_logit = (40 + 20.3125 - credit * 15) + 5
    assert _logits(busy, floor, overlap_score_credit_decay=1.0) == pytest.approx(
        [busy_logit, 20.3125 + 20], rel=1e-15
    )
    # without decay the full credit: 60.3125 - 15 + 5
    assert _logits(busy, floor) == [50.3125, 40.3125]


def test_active_request_weight() -> None:
    w = WorkerView(0, in_flight=6)
    assert _logits(w, active_request_weight=0.5) == [20.3125 + 20 + 3.0]


def test_temperature_zero_takes_the_lowest_and_breaks_ties_at_random() -> None:
    a, b, c = (WorkerView(w, gpu_blocks=g) for w, g in ((0, 3), (1, 9), (2, 9)))
    chosen = Counter(
        create_router("dynamo", seed=s).route(_req(), View([a, b, c], BLOCK, COST)).worker
        for s in range(200)
    )
    assert set(chosen) == {1, 2} and min(chosen.values()) > 60


def test_softmax_shifts_by_the_lowest_and_divides_by_the_range() -> None:
    # exp(-(c - min) / ((max - min) * T)): at T = 1, costs 10, 20, 30 -> 1, e^-0.5, e^-1
    costs = np.array([10.0, 20.0, 30.0])
    assert softmax_weights(costs, 1.0) == [1.0, math.exp(-0.5), math.exp(-1.0)]
    assert softmax_weights(costs, 0.5) == [1.0, math.exp(-1.0), math.exp(-2.0)]
    # a shift of every cost changes nothing (normalising by the maximum would)
    assert softmax_weights(costs + 1000.0, 1.0) == softmax_weights(costs, 1.0)
    assert softmax_weights(np.array([7.0, 7.0]), 0.3) == [1.0, 1.0]


def test_sampled_choices_follow_the_softmax() -> None:
    workers = [WorkerView(w, queued_prefill_tokens=q) for w, q in ((0, 0), (1, 160), (2, 320))]
    view = View(workers, BLOCK, COST)
    # costs 40.3125, 50.3125, 60.3125: weights 1, e^-0.5, e^-1 at T = 1
    total = 1 + math.exp(-0.5) + math.exp(-1.0)
    expected = [1 / total, math.exp(-0.5) / total, math.exp(-1.0) / total]
    r = create_router("dynamo", temperature=1.0, seed=5)
    n = 6000
    seen = Counter(r.route(_req(), view).worker for _ in range(n))
    for w, p in enumerate(expected):
        # four standard deviations of a binomial count
        assert abs(seen[w] / n - p) < 4 * math.sqrt(p * (1 - p) / n), (w, seen)


@pytest.mark.parametrize(
    "key, value",
    [
        ("overlap_score_credit", 1.5),
        ("overlap_score_credit", -0.1),
        ("host_cache_hit_weight", 2.0),
        ("disk_cache_hit_weight", -1.0),
        ("prefill_load_scale", -1.0),
        ("temperature", -0.5),
        ("overlap_score_credit_decay", float("nan")),
    ],
)
def test_values_dynamo_refuses_are_refused(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        create_router("dynamo", **{key: value})
