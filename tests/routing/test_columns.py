"""The routers that score columns choose exactly what a loop over the workers chooses
(`scalar_reference.py`), request after request with the same seed: ties, random draws
and float rounding included. And a `View` reads the same through its columns and its
workers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.routing import Request, View, WorkerView, create_router
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
    "llm-d": (ref.llmd, {}),
    "sglang": (ref.sglang, {}),
}


@st.composite
def tied_worker_views(draw: st.DrawFn, worker: int, n_blocks: int) -> WorkerView:
    """Few distinct values, so that ties (and tie-breaking draws) are common."""
    gpu = draw(st.sampled_from([0, n_blocks]))
    return WorkerView(
        worker=worker,
        in_flight=draw(st.integers(0, 2)),
        queued_prefill_tokens=draw(st.sampled_from([0, 160])),
        running_decodes=draw(st.integers(0, 1)),
        kv_usage=draw(st.sampled_from([0.0, 0.5])),
        capacity_blocks=100,
        resident_blocks=draw(st.sampled_from([0, 10])),
        gpu_blocks=gpu,
        cpu_blocks=draw(st.sampled_from([gpu, n_blocks])),
        disk_blocks=draw(st.sampled_from([0, n_blocks])),
        matches={"GPU": gpu},
    )


@st.composite
def rounds(draw: st.DrawFn) -> list[tuple[Request, list[WorkerView]]]:
    out = []
    tied = draw(st.booleans())
    for _ in range(draw(st.integers(1, 6))):
        req = draw(requests())
        ids = sorted(draw(st.lists(st.integers(0, 300), min_size=1, max_size=40, unique=True)))
        make = tied_worker_views if tied else worker_views
        out.append((req, [draw(make(w, len(req.content_keys))) for w in ids]))
    return out


def columns_view(workers: list[WorkerView]) -> View:
    return View(None, BLOCK, COST, columns=WorkerColumns.of(workers))


@pytest.mark.parametrize("case", sorted(REFERENCES))
@settings(max_examples=150)
@given(seed=st.integers(0, 2**32), played=rounds())
def test_column_scoring_chooses_as_the_loop_does(
    case: str, seed: int, played: list[tuple[Request, list[WorkerView]]]
) -> None:
    reference, params = REFERENCES[case]
    name = case.removesuffix("-sampled")
    scored = create_router(name, seed=seed, **params)
    looped = create_router(name, seed=seed, **params)
    for turn, (req, workers) in enumerate(played):
        want = reference(looped, req, View(workers, BLOCK, COST), turn)
        got = scored.route(req, columns_view(workers))
        assert got.worker == want, (turn, [w.worker for w in workers])


@given(played=rounds())
def test_a_view_reads_the_same_through_columns_and_workers(
    played: list[tuple[Request, list[WorkerView]]],
) -> None:
    for _, workers in played:
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
