"""The routers that score columns choose exactly what a loop over the workers chooses
(`scalar_reference.py`), request after request with the same seed: ties, random draws
and float rounding included. And a `View` reads the same through its columns and its
workers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.routing import Request, View, WorkerView, create_router
from quillcache.routing.quill import QuillCacheRouter
from quillcache.routing.types import WorkerColumns
from tests.routing import scalar_reference as ref
from tests.routing.strategies import BLOCK, COST, requests, worker_views

REFERENCES: dict[str, tuple[Callable[..., int], dict[str, Any]]] = {
    "round-robin": (ref.round_robin, {}),
    "random": (ref.random_choice, {}),
    "least-loaded": (ref.least_loaded, {}),
    "power-of-two": (ref.power_of_two, {}),
    "session-affinity": (ref.session_affinity, {}),
    "dynamo": (ref.dynamo, {}),
    "dynamo-sampled": (ref.dynamo, {"temperature": 0.7}),
    "dynamo-decayed": (
        ref.dynamo,
        {
            "overlap_score_credit_decay": 2.0,
            "active_request_weight": 0.5,
            "host_cache_hit_weight": 0.4,
        },
    ),
    "llm-d": (ref.llmd, {}),
    "sglang": (ref.sglang, {}),
    "quillcache": (ref.quill, {}),
    "quillcache-worker-scope": (ref.quill, {"work_scope": "worker", "decode_weight": 2.0}),
    "quillcache-plain": (ref.quill, {"interference": False, "speculative": False}),
    "mooncake": (ref.ttft_argmin, {}),
    "preble": (ref.preble, {}),
}


@st.composite
def tied_worker_views(draw: st.DrawFn, worker: int, n_blocks: int) -> WorkerView:
    """Few distinct values, so that ties (and tie-breaking draws) are common."""
    gpu = draw(st.sampled_from([0, n_blocks]))
    queued = draw(st.sampled_from([0, 160]))
    return WorkerView(
        worker=worker,
        in_flight=draw(st.integers(0, 2)),
        queued_prefill_tokens=queued,
        queued_prefill_pairs=queued * draw(st.sampled_from([80.5, 4_000.5])),
        running_decodes=draw(st.integers(0, 1)),
        kv_usage=draw(st.sampled_from([0.0, 0.5])),
        capacity_blocks=100,
        resident_blocks=draw(st.sampled_from([0, 10])),
        mean_context_tokens=draw(st.sampled_from([0.0, 3_000.0])),
        gpu_blocks=gpu,
        cpu_blocks=draw(st.sampled_from([gpu, n_blocks])),
        disk_blocks=draw(st.sampled_from([0, n_blocks])),
        matches={"GPU": gpu},
    )


Played = tuple[CostModel, bool, list[tuple[Request, list[WorkerView], float]]]
PEER_FETCH = CostModel(CostModelConfig().with_overrides({"transfer.allow_peer_fetch": True}))


@st.composite
def rounds(draw: st.DrawFn) -> Played:
    """Requests one after another (the same router keeps its state), each with a view;
    a cost model with or without peer fetch; timed or order-only replay."""
    out = []
    tied = draw(st.booleans())
    now = 0.0
    fleet = draw(st.lists(st.integers(0, 300), min_size=1, max_size=40, unique=True))
    for _ in range(draw(st.integers(1, 6))):
        req = draw(requests())
        req.session_id = draw(st.sampled_from([None, "a", "b", "c", req.session_id]))
        # mostly the same fleet from request to request (sessions stay homed on it)
        ids = sorted(fleet if draw(st.integers(0, 3)) else draw(st.permutations(fleet))[:2])
        make = tied_worker_views if tied else worker_views
        now += draw(st.sampled_from([0.0, 1.0, 60.0]))  # sessions expire after 45 s
        out.append((req, [draw(make(w, len(req.content_keys))) for w in ids], now))
    return draw(st.sampled_from([COST, PEER_FETCH])), draw(st.booleans()), out


def columns_view(workers: list[WorkerView], cost: CostModel = COST, **kw: Any) -> View:
    return View(None, BLOCK, cost, columns=WorkerColumns.of(workers), **kw)


@pytest.mark.parametrize("case", sorted(REFERENCES))
@settings(max_examples=150)
@given(seed=st.integers(0, 2**32), played=rounds())
def test_column_scoring_chooses_as_the_loop_does(case: str, seed: int, played: Played) -> None:
    reference, params = REFERENCES[case]
    name = (
        case.removesuffix("-sampled")
        .removesuffix("-decayed")
        .removesuffix("-worker-scope")
        .removesuffix("-plain")
    )
    scored = create_router(name, seed=seed, **params)
    looped = create_router(name, seed=seed, **params)
    cost, order_only, requests_ = played
    for turn, (req, workers, now) in enumerate(requests_):
        want = reference(looped, req, View(workers, BLOCK, cost, now, order_only), turn)
        got = scored.route(req, columns_view(workers, cost, now_s=now, order_only=order_only))
        assert got.worker == want, (turn, [w.worker for w in workers])


QUILL = {k: v for k, v in REFERENCES.items() if v[0] is ref.quill}


@pytest.mark.parametrize("case", sorted(QUILL))
@given(played=rounds())
def test_quillcache_scores_every_worker_as_estimate_s_does(case: str, played: Played) -> None:
    """Not only the winner: every worker's score, bit for bit, in the state each
    request leaves (sessions homed, decode pile-up, work weight)."""
    router = create_router("quillcache", **QUILL[case][1])
    assert isinstance(router, QuillCacheRouter)
    cost, _, requests_ = played
    for turn, (req, workers, now) in enumerate(requests_):
        plain = View(workers, BLOCK, cost, now)
        ref.quill(router, req, plain, turn)  # sets the per-request state, homes the session
        got = router.estimates(req, columns_view(workers, cost, now_s=now)).tolist()
        assert got == [router.estimate_s(req, plain, w) for w in workers]


@given(played=rounds())
def test_a_view_reads_the_same_through_columns_and_workers(played: Played) -> None:
    for _, workers, _ in played[2]:
        view = columns_view(workers)
        made = view.workers
        for w, m in zip(workers, made, strict=True):
            # matches come from the index's hits, which a bare column view has none of
            assert m == WorkerView(**{**_fields(w), "matches": {}})
        for i, w in enumerate(workers):
            assert view.position(w.worker) == i
            for peer in (w.worker, -1):
                assert view.best_peer_blocks(peer) == _best_peer(workers, peer)


def _fields(w: WorkerView) -> dict[str, Any]:
    return {f: getattr(w, f) for f in WorkerView.__dataclass_fields__}


def _best_peer(workers: list[WorkerView], exclude: int) -> tuple[int | None, int]:
    best, blocks = None, 0
    for w in workers:
        if w.worker != exclude and w.gpu_blocks > blocks:
            best, blocks = w.worker, w.gpu_blocks
    return best, blocks


def test_a_view_is_made_of_workers_or_of_columns() -> None:
    with pytest.raises(TypeError, match="exactly one"):
        View(None, BLOCK, COST)
    cols = WorkerColumns.of([WorkerView(3, in_flight=2)])
    with pytest.raises(TypeError, match="exactly one"):
        View([WorkerView(3)], BLOCK, COST, columns=cols)
    assert np.array_equal(View([WorkerView(3, in_flight=2)], BLOCK, COST).columns.in_flight, [2])


def _docs_example() -> type:
    """The fast custom router of docs/routing.md, run as written there."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text()
    section = text[text.index("### At fleet size") :]
    code = section[section.index("```python") + len("```python") : section.index("```\n", 10)]
    namespace: dict[str, Any] = {}
    exec(code, namespace)
    return namespace["FewestRequestsFast"]


@given(played=rounds())
def test_the_documented_fast_router_chooses_as_its_loop(played: Played) -> None:
    fast = _docs_example()()
    for req, workers, _ in played[2]:
        want = min(workers, key=lambda w: (w.in_flight, w.worker)).worker
        assert fast.route(req, columns_view(workers)).worker == want
        assert fast.route(req, View(workers, BLOCK, COST)).worker == want
