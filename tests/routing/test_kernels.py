"""The cost model's native kernel computes, bit for bit, what the numpy reference does:
`estimate_ttft_s_array` and `QuillCacheRouter.estimates`, and picks the row `first_min`
picks. The fleets here are harder than the routers' own tests: fractional loads (a
scraped engine total spread over ranks), several rows per engine (DP ranks), loads
beyond one chunk budget, every tier, peer fetch on and off, every knob of the router."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.routing import Request, View, WorkerView
from quillcache.routing.base import estimate_ttft_s_array, first_min
from quillcache.routing.quill import QuillCacheRouter
from quillcache.routing.ttft import lowest_ttft_at
from quillcache.routing.types import (
    FLEET_FIELDS,
    LOAD_FIELDS,
    PACE_COLUMN,
    SLOTS_COLUMN,
    WorkerColumns,
)

BLOCK = 16
COSTS = [
    CostModel(),
    CostModel(CostModelConfig().with_overrides({"transfer.allow_peer_fetch": True})),
    CostModel(
        CostModelConfig().with_overrides(
            {"engine.max_num_batched_tokens": 512, "gpu.step_overhead_s": 0.0}
        )
    ),
    # few sequence slots, every one often taken: the slot wait is in the estimate
    CostModel(CostModelConfig().with_overrides({"engine.max_num_seqs": 1})),
    CostModel(CostModelConfig().with_overrides({"engine.max_num_seqs": 12})),
]

loads = st.one_of(
    st.integers(0, 40_000).map(float),
    st.floats(0, 40_000, allow_nan=False),
    st.sampled_from([0.0, 0.5, 8191.5, 8192.0, 8193.0]),
)


@st.composite
def fleets(draw: st.DrawFn) -> tuple[Request, View]:
    blocks = draw(st.integers(0, 24))
    request = Request(
        request_id=1,
        content_keys=np.arange(1, blocks + 1, dtype=np.uint64),
        prompt_tokens=blocks * BLOCK + draw(st.integers(1 if blocks == 0 else 0, BLOCK - 1)),
        expected_output_tokens=draw(st.integers(0, 600)),
    )
    engines = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12, unique=True))
    worker = sorted(w for w in engines for _ in range(draw(st.integers(1, 2))))
    n = len(worker)

    def tier() -> np.ndarray:
        return np.asarray(draw(st.lists(st.integers(0, blocks + 3), min_size=n, max_size=n)))

    load = np.zeros((n, len(LOAD_FIELDS)))
    for i in range(n):
        load[i, 0] = draw(st.one_of(st.integers(0, 64).map(float), st.floats(0, 64)))
        load[i, 1] = draw(loads)
        load[i, 2] = draw(st.one_of(st.integers(0, 600).map(float), st.floats(0, 9_000)))
        load[i, 3] = draw(st.floats(0, 1))
        load[i, 4] = draw(st.floats(0, 32_000))
        # the queued requests' attention pairs: as many as the tokens (no context) up
        # to long contexts, or fewer (an engine that reports tokens only)
        load[i, 5] = load[i, 1] * draw(st.sampled_from([0.0, 1.0, 40.0, 3_000.0, 60_000.0]))
    fleet = np.zeros((n, len(FLEET_FIELDS)))
    # capacity (0: not known), resident blocks (some engines full, some with room) and
    # whether residency is known: the eviction term's inputs
    fleet[:, 0] = draw(st.lists(st.sampled_from([0, 8, 30, 10_000]), min_size=n, max_size=n))
    fleet[:, 1] = [draw(st.integers(0, int(cap) + 4)) for cap in fleet[:, 0]]
    fleet[:, 2] = draw(st.lists(st.sampled_from([1.0, 1.0, 0.0]), min_size=n, max_size=n))
    # most engines at the fleet's pace, some learned slower (`controlplane/pace.py`)
    fleet[:, PACE_COLUMN] = draw(
        st.lists(st.sampled_from([1.0, 1.0, 1.0, 1.37, 2.5, 10.0]), min_size=n, max_size=n)
    )
    # most engines with the cost model's slots, some configured with their own
    fleet[:, SLOTS_COLUMN] = draw(
        st.lists(st.sampled_from([0, 0, 0, 1, 2, 7, 300]), min_size=n, max_size=n)
    )
    columns = WorkerColumns(
        worker=np.asarray(worker, dtype=np.uint64),
        load=load,
        fleet=fleet,
        gpu_blocks=tier().astype(np.int64),
        cpu_blocks=tier().astype(np.int64),
        disk_blocks=tier().astype(np.int64),
        pending_blocks=tier().astype(np.int64),
        dp_rank=np.zeros(n, dtype=np.int64),
        paced=bool((fleet[:, PACE_COLUMN] != 1.0).any()),
        slotted=bool(fleet[:, SLOTS_COLUMN].any()),
    )
    return request, View(None, BLOCK, draw(st.sampled_from(COSTS)), columns=columns)


@settings(max_examples=400)
@given(fleet=fleets())
def test_ttft_kernel_is_the_numpy_estimate(fleet: tuple[Request, View]) -> None:
    request, view = fleet
    c = view.columns
    want = estimate_ttft_s_array(request, view)
    at = lowest_ttft_at(request, view)
    _, got = view.cost.kernel.ttft(
        c.worker,
        c.load,
        c.gpu_blocks,
        c.cpu_blocks,
        c.disk_blocks,
        c.pending_blocks,
        len(request.content_keys),
        request.prompt_tokens,
        view.block_size,
    )
    assert got.tolist() == want.tolist()
    assert at == first_min(want, -c.local_blocks, c.in_flight, c.worker)


knobs = st.fixed_dictionaries(
    {
        "speculative": st.booleans(),
        "interference": st.booleans(),
        "work_weight": st.sampled_from([0.0, 1.0, 2.5]),
        "work_scope": st.sampled_from(["cluster", "worker"]),
        "adaptive": st.booleans(),
        "work_base": st.sampled_from([0.0, 1.0, 3.0]),
        "max_work_weight": st.sampled_from([0.5, 3.0]),
        "decode_weight": st.sampled_from([0.0, 1.0, 2.0]),
        "home_decode_weight": st.sampled_from([0.0, 1.0]),
        "continuing_work_weight": st.sampled_from([0.0, 0.5, 1.0]),
        "evict_weight": st.sampled_from([0.0, 0.25, 1.0]),
    }
)


@settings(max_examples=400)
@given(
    fleet=fleets(),
    options=knobs,
    continuing=st.booleans(),
    mean_decodes=st.floats(0, 600),
    work=st.floats(0, 3),
    homes=st.lists(st.floats(0, 50), max_size=12),
)
def test_quill_kernel_is_the_numpy_estimate(
    fleet: tuple[Request, View],
    options: dict[str, object],
    continuing: bool,
    mean_decodes: float,
    work: float,
    homes: list[float],
) -> None:
    """In any per-request state `route` can leave (the work weight, a continuing
    session, the cluster's mean decodes, a new session's homes)."""
    request, view = fleet
    router = QuillCacheRouter(**options)  # type: ignore[arg-type]
    router._lambda = work
    router._continuing = continuing
    router._mean_decodes = mean_decodes
    ids = view.columns.worker.tolist()
    router._session_kv_tokens = {w: d for w, d in zip(ids, homes, strict=False)}
    want = router.estimates(request, view)
    at, got = router.scored(request, view)
    assert got.tolist() == want.tolist()
    c = view.columns
    reuse = -np.maximum(c.local_blocks, c.pending_blocks)
    assert at == first_min(want, reuse, c.in_flight, c.worker)


def test_an_engine_s_own_sequence_slots_price_its_wait() -> None:
    """Two engines, the request's prefix cached on the first, which has 2 requests in
    flight: with the cost model's 256 slots it wins; configured with 2 slots of its own
    the wait for one outweighs the prefix and the idle engine wins, in the kernel and
    in the readable reference alike. A slot count below 1 (other than 0) is refused."""
    keys = np.arange(1, 9, dtype=np.uint64)
    request = Request(1, keys, 8 * BLOCK, expected_output_tokens=200)

    def view(slots: int) -> View:
        holder = WorkerView(
            0,
            in_flight=2,
            running_decodes=2,
            mean_context_tokens=4_000.0,
            gpu_blocks=8,
            max_num_seqs=slots,
        )
        return View([holder, WorkerView(1)], BLOCK, CostModel())

    for slots, winner in ((0, 0), (256, 0), (2, 1)):
        v = view(slots)
        router = QuillCacheRouter()
        assert v.columns.slotted == bool(slots)
        at, got = router.scored(request, v)
        assert got.tolist() == router.estimates(request, v).tolist()
        assert at == winner, (slots, got)
    c = view(2).columns
    with pytest.raises(ValueError, match="at least 1"):
        CostModel().kernel.quill(
            c.worker,
            c.load,
            c.gpu_blocks,
            c.cpu_blocks,
            c.disk_blocks,
            c.pending_blocks,
            8,
            8 * BLOCK,
            BLOCK,
            *QuillCacheRouter()._kernel_state(request, view(2))[:7],
            np.asarray([0.5, 0.0]),
        )


def test_the_kernel_refuses_columns_of_different_lengths() -> None:
    kernel = CostModel().kernel
    ids = np.arange(3, dtype=np.uint64)
    tiers = np.zeros(3, dtype=np.int64)
    with pytest.raises(ValueError, match="disagree"):
        kernel.ttft(ids, np.zeros((2, len(LOAD_FIELDS))), tiers, tiers, tiers, tiers, 1, 16, 16)
    with pytest.raises(ValueError, match=f"{len(LOAD_FIELDS)} columns"):
        kernel.ttft(ids, np.zeros((3, 4)), tiers, tiers, tiers, tiers, 1, 16, 16)
    with pytest.raises(ValueError, match="no rows"):
        empty = np.zeros(0, dtype=np.int64)
        kernel.ttft(ids[:0], np.zeros((0, len(LOAD_FIELDS))), empty, empty, empty, empty, 1, 16, 16)


def test_a_cost_model_pickles_with_its_kernel() -> None:
    import pickle

    cost = CostModel(CostModelConfig().with_overrides({"transfer.allow_peer_fetch": True}))
    copy = pickle.loads(pickle.dumps(cost))
    assert copy.config == cost.config
    ids = np.arange(2, dtype=np.uint64)
    tiers = np.array([0, 3], dtype=np.int64)
    args = (ids, np.ones((2, len(LOAD_FIELDS))), tiers, tiers, tiers, tiers, 3, 50, 16)
    assert copy.kernel.ttft(*args)[1].tolist() == cost.kernel.ttft(*args)[1].tolist()


@settings(max_examples=300)
@given(
    fleet=fleets(),
    shuffled=st.booleans(),
    counts=st.lists(st.integers(0, 5), min_size=1, max_size=14),
    strangers=st.lists(st.integers(0, 2**64 - 1), max_size=3),
)
def test_a_new_sessions_homes_count_every_row_of_its_workers(
    fleet: tuple[Request, View],
    shuffled: bool,
    counts: list[int],
    strangers: list[int],
) -> None:
    """The KV a new session's home's decodes read per step, per row, as the per-row
    sum over the view computes it (the fleet's decode KV per live session): ranks of
    one engine each count, workers outside the view do not, a view out of id order
    too."""
    request, view = fleet
    c = view.columns
    if shuffled:
        order = np.random.default_rng(len(c.worker)).permutation(len(c.worker))
        c = WorkerColumns(
            c.worker[order],
            c.load[order],
            c.fleet[order],
            c.gpu_blocks[order],
            c.cpu_blocks[order],
            c.disk_blocks[order],
            c.pending_blocks[order],
            c.dp_rank[order],
            c.paced,
            c.slotted,
        )
        view = View(None, BLOCK, view.cost, columns=c)
    ids = c.worker.tolist()
    live = dict(zip(list(dict.fromkeys(ids)) + strangers, counts, strict=False))
    router = QuillCacheRouter()
    router._live = dict(live)
    router._session_load("new", view)
    total = sum(live.get(w, 0) for w in ids)
    decodes, contexts = c.running_decodes.tolist(), c.mean_context_tokens.tolist()
    kv = math.fsum(d * ctx for d, ctx in zip(decodes, contexts, strict=True))
    want = [live.get(w, 0) * (kv / total) if total else 0.0 for w in ids]
    assert [router._session_kv_tokens.get(w, 0.0) for w in ids] == want
    _, got = router.scored(request, view)
    assert got.tolist() == router.estimates(request, view).tolist()
