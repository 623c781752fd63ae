"""`ControlPlane.route(..., only=)`: every router picks among the candidates it is shown.

The gateway restricts candidates to the engines serving the requested model. Here the
workers outside the candidate set hold the request's whole prefix (GPU residency from
real events, and speculative residency from earlier decisions), so a cache-aware router
that looked past the view would be caught; sessions and alternating candidate sets
exercise the routers that keep state (rings, session homes).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane, RouterContractError
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import Decision, Request, Router, View, available_routers

BS = 4
MODEL = "cand-model"
NS = namespace_id(model=MODEL, block_size=BS)
WORKERS = 5


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(6 * BS)]


def _request(rid: int, tokens: list[int], session: str | None) -> Request:
    keys = np.array(content_keys(tokens, BS, NS), dtype=np.uint64)
    return Request(rid, keys, len(tokens) + 1, namespace=NS, session_id=session)


def _stored(tokens: list[int], salt: int) -> bytes:
    n = len(tokens) // BS
    ev = BlockStored(
        block_hashes=[salt * 100 + i for i in range(n)],
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BS,
    )
    return encode_batch([ev], 1.0, 0)


@pytest.mark.parametrize("name", available_routers())
@settings(max_examples=15, deadline=None)
@given(
    sets=st.lists(
        st.frozensets(st.integers(0, WORKERS - 1), min_size=1, max_size=WORKERS - 1),
        min_size=1,
        max_size=4,
    ),
    sessions=st.booleans(),
)
def test_every_router_stays_among_the_candidates(
    name: str, sets: list[frozenset[int]], sessions: bool
) -> None:
    cp = ControlPlane(index="native", router=name, block_size=BS, track_load=True)
    try:
        for w in range(WORKERS):
            cp.add_worker(w, capacity_blocks=1000, model=MODEL)
        prompts = [_prompt(i) for i in range(3)]
        rid = 0
        for only in sets:
            outside = [w for w in range(WORKERS) if w not in only]
            for w in outside:  # the tempting holders are exactly the excluded workers
                cp.ingest(w, [_stored(p, w * 10 + i) for i, p in enumerate(prompts)])
            for i, tokens in enumerate(prompts * 2):
                rid += 1
                session = f"s{i % 3}" if sessions else None
                decision = cp.route(_request(rid, tokens, session), now_s=rid * 0.01, only=only)
                assert decision.worker in only, (name, only, decision)
                # an unrestricted view would have shown the excluded holders
                full = {w.worker for w in cp.view(_request(0, tokens, None)).workers}
                assert full == set(range(WORKERS))
                cp.finish(rid)
            for w in outside:
                cp.clear(w)
    finally:
        cp.close()


def test_no_candidate_left_is_a_rejection() -> None:
    cp = ControlPlane(index="memory", router="round-robin", block_size=BS)
    cp.add_worker(0, capacity_blocks=100, model=MODEL)
    cp.add_worker(1, capacity_blocks=100, model=MODEL)
    cp.set_draining(1)
    decision = cp.route(_request(1, _prompt(0), None), only=frozenset({1}))
    assert decision.rejected and "no routable worker" in decision.reason
    assert cp.route(_request(2, _prompt(0), None), only=frozenset({0, 1})).worker == 0


class _Stubborn(Router):
    """A user's router that ignores the view and always names worker 0."""

    name = "stubborn"

    def route(self, request: Request, view: View) -> Decision:
        return Decision(worker=0)


def test_a_router_choosing_outside_its_view_is_a_typed_error() -> None:
    cp = ControlPlane(index="memory", router=_Stubborn(), block_size=BS)
    for w in range(2):
        cp.add_worker(w, capacity_blocks=100, model=MODEL)
    assert cp.route(_request(1, _prompt(0), None)).worker == 0
    with pytest.raises(RouterContractError, match="not among the candidates"):
        cp.route(_request(2, _prompt(0), None), only=frozenset({1}))
