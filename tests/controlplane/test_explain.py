"""Explained decisions (`quillcache.controlplane.explain`) against a brute-force reference.

The reference reads every row of the view as `WorkerView`s (`view.workers`), the
definition in the module's docstring written out: usable prefix = the longest local
tier or pending prefix, capped at the request's blocks, in tokens capped at the
prompt; the KV-optimal row is the first (in view order) with the longest. Planes are
prunable (`prune_min_rows=1`, the explanation reads only the rows above the floor) or
not; fleets are small and prefixes short so that ties and floors are common.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.explain import MAX_CANDIDATES, Explanation
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import BUILTIN_ORDER, Request, View
from quillcache.routing.types import Decision, WorkerView

BS = 4
MODEL = "explain-model"
NS = namespace_id(model=MODEL, block_size=BS)


def tokens(family: int, blocks: int) -> list[int]:
    return [family * 1_000 + t for t in range(blocks * BS)]


def keys_of(family: int, blocks: int) -> np.ndarray:
    return np.array(content_keys(tokens(family, blocks), BS, NS), np.uint64)


def reference(request: Request, view: View, decision: Decision) -> dict[str, object]:
    n = len(request.content_keys)

    def usable(w: WorkerView) -> int:
        return min(max(w.gpu_blocks, w.cpu_blocks, w.disk_blocks, w.pending_blocks), n)

    rows = view.workers
    best = None
    for w in rows:  # the first with the longest: view order is id, then rank
        if best is None or usable(w) > usable(best):
            best = w
    chosen_blocks = 0
    if decision.worker is not None:
        chosen_blocks = next(
            usable(w)
            for w in rows
            if (w.worker, w.dp_rank) == (decision.worker, decision.dp_rank or 0)
        )
    best_blocks = usable(best) if best is not None else 0
    return {
        "kv_optimal": (best.worker, best.dp_rank) if best is not None else None,
        "usable_blocks": chosen_blocks,
        "avoided_tokens": min(chosen_blocks * BS, request.prompt_tokens)
        if decision.worker is not None
        else 0,
        "avoidable_tokens": min(best_blocks * BS, request.prompt_tokens),
    }


def seen(e: Explanation) -> dict[str, object]:
    return {
        "kv_optimal": e.kv_optimal,
        "usable_blocks": e.usable_blocks,
        "avoided_tokens": e.avoided_tokens,
        "avoidable_tokens": e.avoidable_tokens,
    }


@pytest.mark.parametrize("router", ["quillcache", "round-robin", "least-loaded"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_explanations_match_the_brute_force_reference(router: str, data: st.DataObject) -> None:
    assert router in BUILTIN_ORDER
    plane = ControlPlane(
        index="native",
        router=router,
        block_size=BS,
        track_load=True,
        prune_min_rows=data.draw(st.sampled_from([1, None])),
        explain=True,
    )
    try:
        ids = sorted(data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=10, unique=True)))
        ranks = {w: data.draw(st.sampled_from([1, 1, 2])) for w in ids}
        for w in ids:
            plane.add_worker(w, capacity_blocks=500, dp_ranks=ranks[w], model=MODEL)
        next_hash = 1
        everyone = data.draw(st.booleans())  # a first block every rank holds: a floor
        for w in ids:
            for rank in range(ranks[w]):
                if everyone or data.draw(st.booleans()):
                    ev = BlockStored([next_hash], None, tokens(0, 1), BS)
                    next_hash += 1
                    plane.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        for _ in range(data.draw(st.integers(0, 6))):
            w = data.draw(st.sampled_from(ids))
            rank = data.draw(st.integers(0, ranks[w] - 1))
            n = data.draw(st.integers(2, 6))
            ev = BlockStored(
                list(range(next_hash, next_hash + n)),
                None,
                tokens(data.draw(st.integers(0, 2)), n),
                BS,
                medium=data.draw(st.sampled_from(["GPU", "CPU", "DISK"])),
            )
            next_hash += n
            plane.ingest(w, [encode_batch([ev], 1.0, rank)], rank)
        for w in ids:
            if data.draw(st.integers(0, 5)) == 0:
                plane.set_draining(w)
        expected_decisions = 0
        for rid in range(data.draw(st.integers(1, 10))):
            blocks = data.draw(st.integers(1, 7))
            request = Request(
                rid,
                keys_of(data.draw(st.integers(0, 2)), blocks),
                blocks * BS - data.draw(st.integers(0, BS - 1)),  # a partial last block
                arrival_s=float(rid),
            )
            view = plane.view(request, now_s=float(rid))  # the same view route builds
            decision = plane.route(request, now_s=float(rid), candidates=True)
            e = decision.explanation
            assert e is not None
            assert seen(e) == reference(request, view, decision), f"request {rid}"
            assert e.regret_tokens >= 0
            assert e.is_kv_optimal == (decision.worker is not None and e.regret_tokens == 0)
            assert e.reason == decision.reason
            assert len(e.candidates) <= MAX_CANDIDATES + 2
            if e.kv_optimal is not None:
                assert e.kv_optimal in {(c.worker, c.dp_rank) for c in e.candidates}
            expected_decisions += decision.worker is not None
            if decision.worker is not None and data.draw(st.booleans()):
                plane.finish(rid)  # else its blocks stay pending: the next views see them
        assert plane.explain_totals.decisions == expected_decisions
    finally:
        plane.close()


def test_an_engine_holding_the_prefix_is_kv_optimal_and_a_miss_is_regret() -> None:
    # without speculative tracking: the first request's blocks would be pending on its
    # engine, and the next ones' longest usable prefix there too
    plane = ControlPlane(
        index="native", router="round-robin", block_size=BS, explain=True, speculative=False
    )
    try:
        for w in (1, 2, 3):
            plane.add_worker(w, capacity_blocks=100, model=MODEL)
        ev = BlockStored([11, 12, 13], None, tokens(1, 3), BS)
        plane.ingest(2, [encode_batch([ev], 1.0)])
        request = Request("r", keys_of(1, 3), 3 * BS + 1)
        decisions = [plane.route(Request(i, keys_of(1, 3), 3 * BS + 1)) for i in range(3)]
        for d in decisions:
            e = d.explanation
            assert e is not None and e.kv_optimal == (2, 0)
            assert e.avoidable_tokens == 3 * BS
            assert e.regret_tokens == (0 if d.worker == 2 else 3 * BS)
        totals = plane.explain_totals
        assert (totals.decisions, totals.kv_optimal) == (3, 1)
        assert totals.avoidable_tokens - totals.avoided_tokens == 2 * 3 * BS
        assert plane.route(request, explain=False).explanation is None
        assert plane.explain_totals.decisions == 3
    finally:
        plane.close()


def test_off_by_default() -> None:
    plane = ControlPlane(index="native", router="round-robin", block_size=BS)
    try:
        plane.add_worker(1, capacity_blocks=10, model=MODEL)
        assert plane.route(Request(1, keys_of(0, 2), 2 * BS)).explanation is None
        assert plane.explain_totals.decisions == 0
    finally:
        plane.close()
