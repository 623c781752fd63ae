"""Data-parallel engines: one routing row per (worker, dp rank), with the rank's own
cache, load and speculative placements, and decisions that name the rank."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from quillcache.controlplane import (
    ControlPlane,
    RouterContractError,
    UnknownSourceError,
)
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Decision, Request, Router, View

BS = 4
MODEL = "dp-model"
NS = namespace_id(model=MODEL, block_size=BS)


def _tokens(family: int, blocks: int = 4) -> list[int]:
    return [family * 1_000 + t for t in range(blocks * BS)]


def _stored(family: int, rank: int, blocks: int = 4, first_hash: int = 1) -> bytes:
    ev = BlockStored(
        block_hashes=list(range(first_hash, first_hash + blocks)),
        parent_block_hash=None,
        token_ids=_tokens(family, blocks),
        block_size=BS,
        medium="GPU",
    )
    return encode_batch([ev], 1.0, rank)


def _request(rid: int, family: int, blocks: int = 4) -> Request:
    keys = np.array(content_keys(_tokens(family, blocks), BS, NS), dtype=np.uint64)
    return Request(rid, keys, blocks * BS + 1)


@pytest.fixture(params=["native", "memory"])
def index(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _plane(index: str, router: str | Router, **kw: object) -> ControlPlane:
    cp = ControlPlane(index=index, router=router, block_size=BS, **kw)  # type: ignore[arg-type]
    cp.add_worker(0, capacity_blocks=100, model=MODEL)
    cp.add_worker(7, capacity_blocks=100, dp_ranks=2, model=MODEL)
    return cp


@pytest.fixture
def plane(index: str) -> Iterator[ControlPlane]:
    cp = _plane(index, "quillcache-greedy", track_load=True)
    yield cp
    cp.close()


def test_each_rank_is_a_row_with_its_own_cache(plane: ControlPlane) -> None:
    plane.ingest(7, [_stored(1, 1)], dp_rank=1)
    rows = {(w.worker, w.dp_rank): w for w in plane.view(_request(1, 1)).workers}
    assert list(rows) == [(0, 0), (7, 0), (7, 1)]
    assert {k: w.gpu_blocks for k, w in rows.items()} == {(0, 0): 0, (7, 0): 0, (7, 1): 4}
    assert rows[7, 1].matches == {"GPU": 4} and rows[7, 0].matches == {}
    assert {k: w.resident_blocks for k, w in rows.items()} == {(0, 0): 0, (7, 0): 0, (7, 1): 4}
    assert [w.capacity_blocks for w in rows.values()] == [100, 100, 100]
    assert plane.worker(7).resident_blocks == 4 and plane.worker(7).capacity_blocks == 200
    c = plane.view(_request(1, 1)).columns
    assert c.dp_rank.tolist() == [0, 0, 1] and c.worker.tolist() == [0, 7, 7]


def test_a_decision_names_the_rank_that_holds_the_prefix(plane: ControlPlane) -> None:
    plane.ingest(7, [_stored(1, 1)], dp_rank=1)
    decision = plane.route(_request(1, 1))
    assert (decision.worker, decision.dp_rank) == (7, 1)
    assert plane.worker(7).rank_state(1)["in_flight"] == 1
    assert plane.worker(7).rank_state(0)["in_flight"] == 0
    # its prefix is now being computed there: a twin request sees it pending on rank 1
    rows = {(w.worker, w.dp_rank): w.pending_blocks for w in plane.view(_request(2, 1)).workers}
    assert rows == {(0, 0): 0, (7, 0): 0, (7, 1): 4}
    plane.finish(1)
    assert plane.worker(7).rank_state(1)["in_flight"] == 0


def test_load_is_booked_per_rank_so_ranks_share_the_work(index: str) -> None:
    cp = _plane(index, "least-loaded", track_load=True)
    try:
        chosen = [cp.route(_request(i, 10 + i)) for i in range(6)]
        on = [(d.worker, d.dp_rank) for d in chosen]
        assert on == [(0, 0), (7, 0), (7, 1)] * 2
        assert [cp.worker(7).rank_state(r)["in_flight"] for r in (0, 1)] == [2, 2]
        assert cp.worker(7).in_flight == 4
        cp.prefill_done(2)  # rank 1's first request decodes now
        assert cp.worker(7).rank_state(1)["running_decodes"] == 1
        assert cp.worker(7).rank_state(0)["running_decodes"] == 0
        for i in range(6):
            cp.finish(i)
        assert cp.worker(7).in_flight == 0 and cp.worker(7).running_decodes == 0
    finally:
        cp.close()


class _EngineOnly(Router):
    """A router that thinks in engines: it names the worker, never a rank."""

    name = "engine-only"

    def __init__(self, worker: int, dp_rank: int | None = None) -> None:
        super().__init__()
        self.worker, self.dp_rank = worker, dp_rank

    def route(self, request: Request, view: View) -> Decision:
        return Decision(self.worker, dp_rank=self.dp_rank)


def test_a_decision_without_a_rank_goes_to_the_rank_holding_the_prefix(index: str) -> None:
    cp = _plane(index, _EngineOnly(7), track_load=True)
    try:
        cp.ingest(7, [_stored(1, 1)], dp_rank=1)
        assert cp.route(_request(1, 1)).dp_rank == 1
        # nothing cached anywhere: the rank with fewer requests in flight
        assert cp.route(_request(2, 2)).dp_rank == 0
        cp.finish(1)
        assert cp.route(_request(3, 3)).dp_rank == 1
        # equal in every way: the lowest rank
        assert cp.route(_request(4, 4)).dp_rank == 0
        assert [cp.worker(7).rank_state(r)["in_flight"] for r in (0, 1)] == [2, 1]
    finally:
        cp.close()


def test_a_rank_the_worker_does_not_have_is_a_contract_error(index: str) -> None:
    cp = _plane(index, _EngineOnly(7, dp_rank=2))
    try:
        with pytest.raises(RouterContractError, match="dp rank 2 of worker 7"):
            cp.route(_request(1, 1))
        cp.router = _EngineOnly(0, dp_rank=1)
        with pytest.raises(RouterContractError, match="dp rank 1 of worker 0"):
            cp.route(_request(2, 1))
    finally:
        cp.close()


def test_events_of_an_unknown_rank_are_refused_and_change_nothing(plane: ControlPlane) -> None:
    with pytest.raises(UnknownSourceError, match=r"dp ranks 0\.\.1, not 2"):
        plane.ingest(7, [_stored(1, 2)], dp_rank=2)
    assert plane.match(_request(1, 1).content_keys) == []
    with pytest.raises(UnknownSourceError):
        plane.update_rank_load(0, 1, in_flight=3)


def test_an_engine_level_report_keeps_what_each_rank_was_booked(plane: ControlPlane) -> None:
    plane.update_rank_load(7, 0, in_flight=3)
    plane.update_rank_load(7, 1, in_flight=1)
    plane.update_load(7, in_flight=8, kv_usage=0.5)  # the engine says 8 in all
    ranks = [plane.worker(7).rank_state(r) for r in (0, 1)]
    assert [r["in_flight"] for r in ranks] == [5, 3]
    assert [r["kv_usage"] for r in ranks] == [0.5, 0.5]
    plane.update_load(7, in_flight=2)  # 6 fewer: 3 off each
    assert [plane.worker(7).rank_state(r)["in_flight"] for r in (0, 1)] == [2, 0]
    plane.update_load(7, in_flight=1)  # rank 1 cannot give any: an even split
    assert [plane.worker(7).rank_state(r)["in_flight"] for r in (0, 1)] == [0.5, 0.5]
    assert plane.worker(7).in_flight == 1 and plane.worker(7).kv_usage == 0.5


def test_a_removed_engine_frees_every_rank_row(plane: ControlPlane) -> None:
    plane.route(_request(1, 1))
    plane.remove_worker(7)
    plane.add_worker(9, capacity_blocks=50, dp_ranks=3, model=MODEL)
    plane.ingest(9, [_stored(2, 2)], dp_rank=2)
    rows = {(w.worker, w.dp_rank): w for w in plane.view(_request(2, 2)).workers}
    assert list(rows) == [(0, 0), (9, 0), (9, 1), (9, 2)]
    assert [rows[9, r].in_flight for r in range(3)] == [0, 0, 0]
    assert [rows[9, r].gpu_blocks for r in range(3)] == [0, 0, 4]
    assert [rows[9, r].pending_blocks for r in range(3)] == [0, 0, 0]


def test_an_engine_re_added_with_fewer_ranks_forgets_what_ran_on_the_others(
    plane: ControlPlane,
) -> None:
    """A request routed to rank 1 of an engine that comes back with one rank must not,
    when it ends, take load off the row's next owner."""
    plane.ingest(7, [_stored(1, 1)], dp_rank=1)
    decision = plane.route(_request(1, 1))
    assert (decision.worker, decision.dp_rank) == (7, 1)
    plane.add_worker(7, capacity_blocks=100, dp_ranks=1, model=MODEL)
    plane.add_worker(8, capacity_blocks=100, model=MODEL)  # takes the freed row
    plane.update_load(8, in_flight=5)
    plane.finish(1)
    assert plane.worker(8).in_flight == 5
