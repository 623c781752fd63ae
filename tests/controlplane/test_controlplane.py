"""ControlPlane end to end with real index backends and real wire-format events."""

from __future__ import annotations

import numpy as np
import pytest

from quillcache.controlplane import ControlPlane, UnknownWorkerError
from quillcache.errors import ConfigError, EventDecodeError
from quillcache.events.encode import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Action, Request

BS = 4
MODEL = "cp-model"
NS = namespace_id(model=MODEL, block_size=BS)
TOKENS = list(range(100, 124))  # 6 blocks
KEYS = content_keys(TOKENS, BS, NS)


def _stored(hashes: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> bytes:
    ev = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        medium=medium,
    )
    return encode_batch([ev], 1.0, 0)


def _request(rid: int = 1, tokens: list[int] = TOKENS) -> Request:
    keys = np.array(content_keys(tokens, BS, NS), dtype=np.uint64)
    return Request(rid, keys, len(tokens) + 1)


@pytest.fixture(params=["memory", "native"])
def cp(request: pytest.FixtureRequest) -> ControlPlane:
    plane = ControlPlane(index=request.param, router="quillcache-greedy", block_size=BS)
    for w in range(3):
        plane.add_worker(w, capacity_blocks=1000, model=MODEL)
    yield plane
    plane.close()


def test_events_drive_the_view_and_the_decision(cp: ControlPlane) -> None:
    # worker 1 holds the first 4 blocks on GPU, worker 2 the first 6 in CPU
    stats = cp.ingest(1, [_stored([11, 12, 13, 14], None, TOKENS[:16])])
    assert stats.blocks_stored == 4
    cp.ingest(2, [_stored([21, 22, 23, 24, 25, 26], None, TOKENS, medium="CPU")])
    view = cp.view(_request())
    by = {w.worker: w for w in view.workers}
    assert (by[0].gpu_blocks, by[1].gpu_blocks, by[2].cpu_blocks) == (0, 4, 6)
    assert by[1].resident_blocks == 4
    decision = cp.route(_request())
    assert decision.worker in (1, 2)
    assert Action.RECOMPUTE not in decision.actions()[:4]
    # a removal makes the worker lose its match
    cp.ingest(1, [encode_batch([BlockRemoved(block_hashes=[14])], 2.0, 0)])
    assert {w.worker: w.gpu_blocks for w in cp.view(_request()).workers}[1] == 3
    cp.ingest(1, [encode_batch([AllBlocksCleared()], 3.0, 0)])
    assert {w.worker: w.gpu_blocks for w in cp.view(_request()).workers}[1] == 0


def test_other_namespaces_never_match(cp: ControlPlane) -> None:
    cp.ingest(1, [_stored([11, 12], None, TOKENS[:8])])
    other = namespace_id(model="another-model", block_size=BS)
    keys = np.array(content_keys(TOKENS, BS, other), dtype=np.uint64)
    assert all(w.gpu_blocks == 0 for w in cp.view(Request(1, keys, 25)).workers)


def test_speculative_residency_until_prefill_done(cp: ControlPlane) -> None:
    d = cp.route(_request(rid=7))
    pend = {w.worker: w.pending_blocks for w in cp.view(_request(rid=8)).workers}
    assert pend[d.worker] == len(KEYS) and sum(pend.values()) == len(KEYS)
    # a request sharing only 2 blocks sees 2 pending blocks
    partial = _request(rid=9, tokens=TOKENS[:8] + [1] * 8)
    assert {w.worker: w.pending_blocks for w in cp.view(partial).workers}[d.worker] == 2
    cp.prefill_done(7)
    assert all(w.pending_blocks == 0 for w in cp.view(_request(rid=8)).workers)
    cp.finish(7)


def test_speculative_entries_expire() -> None:
    cp = ControlPlane(index="memory", router="round-robin", block_size=BS, speculative_ttl_s=5)
    cp.add_worker(0, capacity_blocks=10, model=MODEL)
    cp.route(_request(rid=1), now_s=0.0)
    assert cp.view(_request(), now_s=4.0).workers[0].pending_blocks == len(KEYS)
    assert cp.view(_request(), now_s=6.0).workers[0].pending_blocks == 0


def test_track_load_accounting() -> None:
    cp = ControlPlane(index="memory", router="least-loaded", block_size=BS, track_load=True)
    for w in range(2):
        cp.add_worker(w, capacity_blocks=10, model=MODEL)
    a = cp.route(_request(rid=1))
    b = cp.route(_request(rid=2, tokens=[7] * 24))
    assert a.worker != b.worker  # the first one is loaded now
    s = cp.worker(a.worker)
    assert s.in_flight == 1 and s.queued_prefill_tokens == 25
    cp.prefill_done(1)
    assert (s.queued_prefill_tokens, s.running_decodes) == (0, 1)
    cp.finish(1)
    cp.finish(1)  # idempotent
    assert (s.in_flight, s.running_decodes) == (0, 0)


def test_workers_drain_and_remove(cp: ControlPlane) -> None:
    cp.ingest(1, [_stored([11, 12], None, TOKENS[:8])])
    cp.set_draining(1)
    assert [w.worker for w in cp.view(_request()).workers] == [0, 2]
    cp.set_draining(1, False)
    assert cp.remove_worker(1) == 2
    assert [w.worker for w in cp.view(_request()).workers] == [0, 2]
    with pytest.raises(UnknownWorkerError, match="unknown worker 1"):
        cp.ingest(1, [])
    with pytest.raises(ConfigError, match="unknown load field"):
        cp.update_load(0, bogus=1)


@pytest.mark.parametrize("bad", [{"bogus": 1.0}, {"running_decodes": -1.0}])
def test_a_load_report_with_a_bad_field_changes_no_field(
    cp: ControlPlane, bad: dict[str, float]
) -> None:
    """The report is checked whole before any field is set: a bad field after good
    ones leaves the row as it was (a partial report would mix two moments)."""
    cp.update_load(0, queued_prefill_tokens=7.0, running_decodes=2.0)
    with pytest.raises(ConfigError):
        cp.update_load(0, queued_prefill_tokens=99.0, kv_usage=0.5, **bad)
    s = cp.worker(0)
    assert (s.queued_prefill_tokens, s.running_decodes, s.kv_usage) == (7.0, 2.0, 0.0)


def test_all_draining_is_a_rejection(cp: ControlPlane) -> None:
    for w in range(3):
        cp.set_draining(w)
    d = cp.route(_request())
    assert d.rejected and "no routable worker" in d.reason


def test_bad_payload_is_a_typed_error_and_earlier_batches_apply(cp: ControlPlane) -> None:
    good = _stored([11, 12], None, TOKENS[:8])
    with pytest.raises(EventDecodeError):
        cp.ingest(1, [good, b"\xc1not msgpack"])
    assert {w.worker: w.gpu_blocks for w in cp.view(_request()).workers}[1] == 2


def test_a_stale_source_makes_its_workers_residency_unknown_until_rebuilt(
    cp: ControlPlane,
) -> None:
    """The ingestor marks a source stale through the sink (events lost beyond replay):
    routers see that worker's match as a lower bound until the source is rebuilt, and a
    worker with two ranks stays unknown while either of them is stale."""
    from quillcache.connectors.sink import ControlPlaneSink

    sink = ControlPlaneSink(cp)
    cp.add_worker(1, capacity_blocks=1000, dp_ranks=2, model=MODEL)
    cp.ingest(1, [_stored([11, 12], None, TOKENS[:8])])

    def known() -> dict[tuple[int, int], bool]:
        return {(w.worker, w.dp_rank): w.residency_known for w in cp.view(_request()).workers}

    assert known() == {(0, 0): True, (1, 0): True, (1, 1): True, (2, 0): True}
    sink.set_stale(1, 0, True)
    sink.set_stale(1, 1, True)
    assert known() == {(0, 0): True, (1, 0): False, (1, 1): False, (2, 0): True}
    assert cp.worker(1).stale_ranks == {0, 1}
    assert {(w.worker, w.dp_rank): w.gpu_blocks for w in cp.view(_request()).workers}[1, 0] == 2
    sink.set_stale(1, 0, False)
    assert known()[1, 0] is True
    assert known()[1, 1] is False  # rank 1 is still being rebuilt
    assert cp.worker(1).stale_ranks == {1}
    sink.set_stale(1, 1, False)
    assert set(known().values()) == {True}
    cp.remove_worker(2)
    sink.set_stale(2, 0, True)  # a worker removed meanwhile: nothing to mark, no error
    assert known() == {(0, 0): True, (1, 0): True, (1, 1): True}


def _routing_growth(plane: ControlPlane, requests: int) -> int:
    """Bytes the plane holds more after `requests` routed and finished requests."""
    import tracemalloc

    def route_some(n: int, start: int) -> None:
        for rid in range(start, start + n):
            plane.route(_request(rid))
            plane.prefill_done(rid)
            plane.finish(rid)

    route_some(200, 0)  # warm: caches, first allocations
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        route_some(requests, 10_000)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(d.size_diff for d in after.compare_to(before, "filename"))


def test_a_long_lived_plane_keeps_no_per_request_samples() -> None:
    from quillcache.controlplane import OpLatencies

    plain = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    plain.add_worker(0, model=MODEL)
    recorder = OpLatencies()
    replay = ControlPlane(
        index="native", router="round-robin", block_size=BS, track_load=True, latencies=recorder
    )
    replay.add_worker(0, model=MODEL)
    try:
        assert _routing_growth(plain, 5_000) < 32_000
        assert _routing_growth(replay, 5_000) > 100_000  # the samples a replay asked for
        assert len(recorder.match_ns) == 5_200
    finally:
        plain.close()
        replay.close()


def test_a_router_cannot_change_the_plane_through_its_view(cp: ControlPlane) -> None:
    cp.update_load(1, in_flight=4)
    view = cp.view(_request())
    for column in (view.columns.worker, view.columns.load, view.columns.fleet):
        with pytest.raises(ValueError, match="read-only"):
            column[0] = 99
    assert cp.worker(1).in_flight == 4
    assert cp.view(_request()).columns.worker.tolist() == [0, 1, 2]


def test_any_u64_worker_id_routes_and_a_huge_draining_one_is_placed_nowhere() -> None:
    huge = 2**64 - 1
    plane = ControlPlane(index="native", router="quillcache-greedy", block_size=BS)
    try:
        for w in (1, 2, huge):
            plane.add_worker(w, capacity_blocks=100, model=MODEL)
        plane.ingest(huge, [_stored(list(range(1, 7)), None, TOKENS)])
        assert plane.route(_request()).worker == huge  # it holds the prompt
        plane.set_draining(huge)
        view = plane.view(_request())  # small ids: a position table; the hit is off it
        assert view.columns.worker.tolist() == [1, 2]
        assert view.columns.gpu_blocks.tolist() == [0, 0]
    finally:
        plane.close()


def test_session_affinity_follows_the_fleet_as_it_changes() -> None:
    plane = ControlPlane(index="native", router="session-affinity", block_size=BS)
    try:
        for w in range(4):
            plane.add_worker(w, model=MODEL)
        req = _request()
        req.session_id = "s-1"
        home = plane.route(req).worker
        assert home is not None and plane.route(req).worker == home  # sticky
        plane.set_draining(home)
        moved = plane.route(req).worker
        assert moved not in (None, home)
        plane.set_draining(home, False)
        assert plane.route(req).worker == home  # the ring of the full fleet again
    finally:
        plane.close()
