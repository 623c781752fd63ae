"""`ControlPlane.move`: a request routed to one worker and sent to another (a booking
step that took another candidate) has its pending blocks and its booked load moved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.plane import UnknownWorkerError
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Request

BS = 4
NS = namespace_id(model="m", block_size=BS)


def keys(family: int, blocks: int = 4) -> np.ndarray:
    tokens = [family * 1_000 + t for t in range(blocks * BS)]
    return np.array(content_keys(tokens, BS, NS), np.uint64)


def plane() -> ControlPlane:
    cp = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    cp.add_worker(0)
    cp.add_worker(1, dp_ranks=2)
    return cp


def pending(cp: ControlPlane, family: int) -> dict[tuple[int, int], int]:
    c = cp.view(Request("probe", keys(family), 4 * BS)).columns
    return {
        (int(w), int(r)): int(p)
        for w, r, p in zip(c.worker, c.dp_rank, c.pending_blocks, strict=True)
        if p
    }


def test_the_prefix_being_computed_and_the_load_follow_the_request() -> None:
    cp = plane()
    try:
        d = cp.route(Request(7, keys(1), 4 * BS))
        assert (d.worker, d.dp_rank) == (0, 0)
        assert pending(cp, 1) == {(0, 0): 4}
        cp.move(7, 1, 1)
        assert pending(cp, 1) == {(1, 1): 4}
        assert cp.worker(0).in_flight == 0 and cp.worker(1).rank_state(1)["in_flight"] == 1
        queued = cp.worker(1).rank_state(1)["queued_prefill_tokens"]
        assert queued == 4 * BS
        cp.prefill_done(7)
        assert pending(cp, 1) == {}
        assert cp.worker(1).rank_state(1)["running_decodes"] == 1
        cp.move(7, 0)  # after its prefill: a decode moves
        assert cp.worker(0).running_decodes == 1 and cp.worker(1).running_decodes == 0
        cp.finish(7)
        assert cp.worker(0).in_flight == cp.worker(0).running_decodes == 0
        cp.move(7, 1)  # finished: nothing to move
        assert cp.worker(1).in_flight == 0
        with pytest.raises(UnknownWorkerError):
            cp.move(8, 5)
        with pytest.raises(UnknownWorkerError):
            cp.move(8, 1, 2)
    finally:
        cp.close()


@settings(max_examples=80, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["route", "move", "prefilled", "finish"]),
            st.integers(0, 5),
            st.sampled_from([(0, 0), (1, 0), (1, 1)]),
        ),
        max_size=30,
    )
)
def test_loads_and_pending_blocks_match_where_requests_are(
    ops: list[tuple[str, int, tuple[int, int]]],
) -> None:
    """Against a model of where each request is and whether it prefilled: in-flight
    counts, running decodes and pending blocks per (worker, rank) agree after every
    step, and all go back to zero once every request finished."""
    cp = plane()
    where: dict[int, tuple[tuple[int, int], bool]] = {}
    try:
        for op, rid, target in ops:
            if op == "route":
                d = cp.route(Request(rid, keys(rid), 4 * BS))
                assert d.worker is not None and d.dp_rank is not None
                where[rid] = ((d.worker, d.dp_rank), False)
            elif op == "move":
                cp.move(rid, *target)
                if rid in where:
                    where[rid] = (target, where[rid][1])
            elif op == "prefilled":
                cp.prefill_done(rid)
                if rid in where:
                    where[rid] = (where[rid][0], True)
            else:
                cp.finish(rid)
                where.pop(rid, None)
            for w, r in [(0, 0), (1, 0), (1, 1)]:
                state = cp.worker(w).rank_state(r)
                mine = [p for (at, p) in where.values() if at == (w, r)]
                assert state["in_flight"] == len(mine)
                assert state["running_decodes"] == sum(mine)
            for rid_, (at, prefilled) in where.items():
                assert pending(cp, rid_).get(at, 0) == (0 if prefilled else 4)
        for rid in list(where):
            cp.finish(rid)
        for w in (0, 1):
            assert cp.worker(w).in_flight == 0 and cp.worker(w).queued_prefill_tokens == 0
    finally:
        cp.close()
