"""`ControlPlane.move`: a request routed to one worker and sent to another (a booking
step that took another candidate) has its pending blocks and its booked load moved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.plane import UnknownWorkerError
from quillcache.errors import ConfigError
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Request

BS = 4
NS = namespace_id(model="m", block_size=BS)


def keys(family: int, blocks: int = 4) -> np.ndarray:
    tokens = [family * 1_000 + t for t in range(blocks * BS)]
    return np.array(content_keys(tokens, BS, NS), np.uint64)


def plane(speculate_when_booked: bool = False) -> ControlPlane:
    cp = ControlPlane(
        index="native",
        router="round-robin",
        block_size=BS,
        track_load=True,
        speculate_when_booked=speculate_when_booked,
    )
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


@settings(max_examples=120, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["route", "move", "booked", "prefilled", "finish"]),
            st.integers(0, 5),
            st.sampled_from([(0, 0), (1, 0), (1, 1)]),
        ),
        max_size=30,
    ),
    when_booked=st.booleans(),
)
def test_loads_and_pending_blocks_match_where_requests_are(
    ops: list[tuple[str, int, tuple[int, int]]], when_booked: bool
) -> None:
    """Against a model of where each request is, whether it prefilled and whether its
    booking said where it went: in-flight counts, running decodes and pending blocks
    per (worker, rank) agree after every step, and all go back to zero once every
    request finished. With `speculate_when_booked` a prefix counts as being computed
    only from its booking on."""
    cp = plane(when_booked)
    # request -> (where, prefilled, booked)
    where: dict[int, tuple[tuple[int, int], bool, bool]] = {}
    try:
        for op, rid, target in ops:
            if op == "route":
                d = cp.route(Request(rid, keys(rid), 4 * BS))
                assert d.worker is not None and d.dp_rank is not None
                where[rid] = ((d.worker, d.dp_rank), False, False)
            elif op in ("move", "booked"):
                getattr(cp, op)(rid, *target)
                if rid in where:
                    _, prefilled, booked = where[rid]
                    where[rid] = (target, prefilled, booked or op == "booked")
            elif op == "prefilled":
                cp.prefill_done(rid)
                if rid in where:
                    where[rid] = (where[rid][0], True, where[rid][2])
            else:
                cp.finish(rid)
                where.pop(rid, None)
            for w, r in [(0, 0), (1, 0), (1, 1)]:
                state = cp.worker(w).rank_state(r)
                mine = [p for (at, p, _) in where.values() if at == (w, r)]
                assert state["in_flight"] == len(mine)
                assert state["running_decodes"] == sum(mine)
            for rid_, (at, prefilled, booked) in where.items():
                counted = not prefilled and (booked or not when_booked)
                assert pending(cp, rid_) == ({at: 4} if counted else {})
        for rid in list(where):
            cp.finish(rid)
        for w in (0, 1):
            assert cp.worker(w).in_flight == 0 and cp.worker(w).queued_prefill_tokens == 0
    finally:
        cp.close()


def test_with_shared_state_a_prefix_is_being_computed_only_where_it_was_booked() -> None:
    """`speculate_when_booked`: routed requests see no prefix being computed until the
    booking names its engine, then there, whether or not it is the router's choice."""
    cp = plane(speculate_when_booked=True)
    try:
        d = cp.route(Request(7, keys(1), 4 * BS))
        assert (d.worker, d.dp_rank) == (0, 0)
        assert pending(cp, 1) == {}  # its booking is in flight
        assert cp.worker(0).in_flight == 1  # its load is counted at once
        cp.booked(7, 1, 1)
        assert pending(cp, 1) == {(1, 1): 4}
        cp.booked(7, 1, 1)  # again: nothing changes
        assert pending(cp, 1) == {(1, 1): 4}
        cp.prefill_done(7)
        assert pending(cp, 1) == {}
        cp.booked(7, 0)  # after its prefill: nothing is pending any more
        assert pending(cp, 1) == {}
    finally:
        cp.close()


def test_an_engine_s_own_sequence_slots_reach_the_view() -> None:
    """`add_worker(max_num_seqs=...)` is per rank, in every view's columns (slotted:
    the kernels read them); a worker re-added without it and a removed worker leave
    the cost model's; a count below 1 is refused."""
    cp = ControlPlane(index="native", router="quillcache", block_size=BS)
    try:
        cp.add_worker(0)
        cp.add_worker(1, dp_ranks=2, max_num_seqs=3)
        c = cp.view(Request("probe", keys(1), 4 * BS)).columns
        assert c.slotted and c.max_num_seqs.tolist() == [0, 3, 3]
        assert cp.worker(1).max_num_seqs == 3 and cp.worker(0).max_num_seqs == 0
        cp.add_worker(1, dp_ranks=2)
        assert not cp.view(Request("probe", keys(1), 4 * BS)).columns.slotted
        cp.add_worker(2, max_num_seqs=5)
        cp.remove_worker(2)
        assert not cp.view(Request("probe", keys(1), 4 * BS)).columns.slotted
        with pytest.raises(ConfigError, match="max_num_seqs"):
            cp.add_worker(3, max_num_seqs=0)
    finally:
        cp.close()
