"""Hypothesis strategies for routing tests: random requests and views."""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from quillcache.costmodel import CostModel
from quillcache.routing import Request, View, WorkerView

COST = CostModel()
BLOCK = 16


@st.composite
def requests(draw: st.DrawFn) -> Request:
    n_blocks = draw(st.integers(0, 40))
    extra = draw(st.integers(1 if n_blocks == 0 else 0, BLOCK - 1))
    keys = np.array(
        draw(st.lists(st.integers(1, 2**64 - 1), min_size=n_blocks, max_size=n_blocks)),
        dtype=np.uint64,
    )
    return Request(
        request_id=draw(st.integers(0, 10**6)),
        content_keys=keys,
        prompt_tokens=n_blocks * BLOCK + extra,
        session_id=draw(st.one_of(st.none(), st.text(min_size=1, max_size=8))),
        expected_output_tokens=draw(st.integers(0, 512)),
    )


@st.composite
def worker_views(draw: st.DrawFn, worker: int, n_blocks: int) -> WorkerView:
    gpu = draw(st.integers(0, n_blocks))
    cpu = draw(st.integers(0, n_blocks))
    in_flight = draw(st.integers(0, 200))
    return WorkerView(
        worker=worker,
        in_flight=in_flight,
        queued_prefill_tokens=draw(st.integers(0, 200_000)),
        running_decodes=draw(st.integers(0, in_flight)),
        kv_usage=draw(st.floats(0, 1)),
        capacity_blocks=draw(st.integers(1, 100_000)),
        resident_blocks=draw(st.integers(0, 100_000)),
        mean_context_tokens=draw(st.floats(0, 32_000)),
        gpu_blocks=gpu,
        cpu_blocks=cpu,
        pending_blocks=draw(st.integers(0, n_blocks)),
        matches={"GPU": gpu, "CPU": cpu},
    )


@st.composite
def request_and_view(draw: st.DrawFn, min_workers: int = 1) -> tuple[Request, View]:
    req = draw(requests())
    ids = draw(st.lists(st.integers(0, 1000), min_size=min_workers, max_size=12, unique=True))
    n = len(req.content_keys)
    workers = [draw(worker_views(w, n)) for w in sorted(ids)]
    return req, View(workers=workers, block_size=BLOCK, cost=COST)
