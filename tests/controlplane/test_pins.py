"""The pin stage: a pinned prefix's holders with room are preferred, for every router."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.pins import PinnedPrefixes
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Request

BS = 4
MODEL = "pin-model"
NS = namespace_id(model=MODEL, block_size=BS)
SYSTEM = list(range(500, 532))  # 8 blocks: the pinned system prompt


def _keys(tokens: list[int]) -> np.ndarray:
    return np.array(content_keys(tokens, BS, NS), dtype=np.uint64)


def _hold(plane: ControlPlane, worker: int, tokens: list[int]) -> None:
    n = len(tokens) // BS
    ev = BlockStored(
        block_hashes=[worker * 1000 + i for i in range(n)],
        parent_block_hash=None,
        token_ids=tokens[: n * BS],
        block_size=BS,
        medium="GPU",
    )
    plane.ingest(worker, [encode_batch([ev], 1.0, 0)])


def _request(rid: int, tail: int) -> Request:
    tokens = SYSTEM + [10_000 + rid * 8 + i for i in range(8)] + [tail]
    return Request(rid, _keys(tokens), len(tokens), expected_output_tokens=4)


@pytest.fixture(params=["round-robin", "quillcache", "llm-d"])
def plane(request: pytest.FixtureRequest) -> ControlPlane:
    cp = ControlPlane(index="native", router=request.param, block_size=BS, track_load=True)
    for w in range(4):
        cp.add_worker(w, capacity_blocks=1000, model=MODEL)
    _hold(cp, 1, SYSTEM)
    _hold(cp, 3, SYSTEM)
    yield cp
    cp.close()


def test_pinned_prefix_routes_to_its_holders_with_room(plane: ControlPlane) -> None:
    plane.pin(_keys(SYSTEM))
    chosen = {plane.route(_request(rid, rid)).worker for rid in range(12)}
    assert chosen <= {1, 3}
    assert chosen == {1, 3}  # the router still balances among the holders


def test_full_holders_are_not_preferred() -> None:
    """Round-robin: whatever it is shown it cycles through, so what it picks is the
    stage's candidate set."""
    plane = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    for w in range(4):
        plane.add_worker(w, capacity_blocks=1000, model=MODEL)
    _hold(plane, 1, SYSTEM)
    _hold(plane, 3, SYSTEM)
    plane.pin(_keys(SYSTEM))
    busy = 10**7  # far more than a second of queued prefill
    plane.update_load(1, queued_prefill_tokens=busy)
    plane.update_load(3, queued_prefill_tokens=busy)
    chosen = {plane.route(_request(rid, rid)).worker for rid in range(12)}
    assert chosen == {0, 1, 2, 3}
    plane.update_load(3, queued_prefill_tokens=0)
    plane.unpin(_keys(SYSTEM))  # no longer pinned: no preference either
    plane.pin(_keys(SYSTEM))
    assert plane.route(_request(99, 99)).worker == 3  # the one holder with room


def test_unpinned_prefix_is_no_preference() -> None:
    cp = ControlPlane(index="native", router="round-robin", block_size=BS, track_load=True)
    for w in range(4):
        cp.add_worker(w, capacity_blocks=1000, model=MODEL)
    _hold(cp, 1, SYSTEM)
    cp.pin(_keys(SYSTEM))
    cp.pin(_keys(SYSTEM))
    cp.unpin(_keys(SYSTEM))  # pinned twice, unpinned once: still pinned
    assert {cp.route(_request(rid, rid)).worker for rid in range(8)} == {1}
    cp.unpin(_keys(SYSTEM))
    assert {cp.route(_request(rid, rid)).worker for rid in range(8, 16)} == {0, 1, 2, 3}
    cp.close()


def test_draining_holder_and_model_subset_are_respected(plane: ControlPlane) -> None:
    plane.pin(_keys(SYSTEM))
    plane.set_draining(1)
    assert {plane.route(_request(r, r)).worker for r in range(6)} == {3}
    # `only` (the engines serving the model) without any holder: the pin gives way
    assert {plane.route(_request(r, r), only=frozenset({0, 2})).worker for r in range(6)} <= {
        0,
        2,
    }


def _longest_reference(keys: list[int], pinned: list[list[int]]) -> int:
    best = 0
    for chain in pinned:
        if len(chain) <= len(keys) and keys[: len(chain)] == chain:
            best = max(best, len(chain))
    return best


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=12),
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), max_size=5),
)
def test_longest_pinned_prefix_matches_a_reference(
    tokens: list[int], pins: list[list[int]]
) -> None:
    """Prefixes over a tiny alphabet (many shared keys, chains pinned inside others)."""
    keys = content_keys([t for t in tokens for _ in range(BS)], BS, NS)
    chains = [content_keys([t for t in p for _ in range(BS)], BS, NS) for p in pins]
    stage = PinnedPrefixes()
    for chain in chains:
        stage.add(np.array(chain, dtype=np.uint64))
    got = stage.longest(np.array(keys, dtype=np.uint64))
    assert got == _longest_reference(keys, chains)


def test_computing_names_the_workers_a_routed_request_computes_a_prefix_on() -> None:
    """`ControlPlane.computing`: the retention policy leaves a prefix to the request
    computing it (routed, not yet prefilled), whole prefixes only, on any dp rank."""
    plane = ControlPlane(index="native", router="round-robin", block_size=16)
    plane.add_worker(0, capacity_blocks=100)
    plane.add_worker(7, capacity_blocks=100, dp_ranks=2)
    keys = np.arange(1, 9, dtype=np.uint64)
    assert plane.computing(keys) == set()
    first = plane.route(Request(1, keys, 8 * 16 + 3))
    second = plane.route(Request(2, keys, 8 * 16 + 3))
    assert {first.worker, second.worker} == {0, 7}
    assert plane.computing(keys) == {0, 7}
    assert plane.computing(keys[:4]) == {0, 7}  # a prefix of what they compute
    longer = np.arange(1, 12, dtype=np.uint64)
    assert plane.computing(longer) == set()  # more than anyone computes
    plane.prefill_done(1)
    assert plane.computing(keys) == {first.worker, second.worker} - {first.worker}
    plane.finish(2)
    assert plane.computing(keys) == set()
    assert plane.computing(np.array([], dtype=np.uint64)) == set()
