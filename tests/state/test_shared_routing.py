"""The gateway's booking step (`quillcache.gateway.shared_routing.SharedRouting`) on a
real server: a router's shortlist that breaks the contract is replaced by the derived
one (the request still booked, counted, logged), and an engine outside the shortlist
that this replica cannot send to is not where a request goes."""

from __future__ import annotations

import asyncio
import logging
import math

import numpy as np
import pytest

from quillcache.costmodel import CostModel
from quillcache.gateway.shared_routing import EngineIds, SharedRouting, ViewCapture
from quillcache.identity import content_keys, namespace
from quillcache.routing import Decision, Request, Router
from quillcache.routing.shortlist import Preference
from quillcache.routing.types import View, WorkerView
from quillcache.state import Candidate, EngineKey, RedisFleetState
from quillcache.state.load_store import SharedLoadStore
from quillcache.state.shortlist import ShortlistPolicy, build_shortlist
from tests.state.helpers import fleet, loads_of, run
from tests.state.server import RedisServer

BS = 16
URLS = ["http://127.0.0.1:9100", "http://127.0.0.1:9101", "http://127.0.0.1:9102"]


def request(rid: int, blocks: int = 4, session: str | None = None) -> Request:
    tokens = [*range(500, 500 + blocks * BS), 3]
    keys = np.asarray(content_keys(tokens, BS, namespace("", "", "", "", BS)), dtype=np.uint64)
    return Request(rid, keys, len(tokens), session_id=session)


class Listed(Router):
    """Routes every request to worker 0 and gives `preferences` as its shortlist."""

    name = "listed"

    def __init__(self, preferences: list[Preference] | None) -> None:
        super().__init__()
        self.preferences = preferences

    def route(self, request: Request, view: View) -> Decision:
        return Decision(0, dp_rank=0, reason="listed")

    def shortlist(
        self, request: Request, view: View, position: int, size: int
    ) -> list[Preference] | None:
        return self.preferences


def routing(state: RedisFleetState, router: Router, workers: int = 3) -> SharedRouting:
    ids = EngineIds()
    for w in range(workers):
        ids.add(w, URLS[w])
    store = SharedLoadStore()
    store.bind(lambda key: None)
    return SharedRouting(
        state, store, ViewCapture(router), ids, block_size=BS, policy=ShortlistPolicy(size=3)
    )


async def decide(shared: SharedRouting, req: Request, view: View) -> tuple[int, int]:
    """The plane's part: the router decides on `view` (captured), then the booking."""
    d = shared.capture.route(req, view)
    assert d.worker is not None
    route = await shared.book(req, d.worker, d.dp_rank or 0)
    return route.worker, route.rank


# (what is wrong, the router's shortlist over a 3-row view, decision at row 0)
BAD = [
    ("empty", []),
    ("not led by the decision", [Preference(1, 5.0), Preference(0, 5.0)]),
    ("a row outside the view", [Preference(0, 5.0), Preference(7, 5.0)]),
    ("a row twice", [Preference(0, 5.0), Preference(0, 5.0)]),
    ("longer than the size", [Preference(r % 3, 1.0) for r in range(4)]),
    ("a negative count", [Preference(0, -1.0)]),
    ("a count not finite", [Preference(0, 1.0, math.nan)]),
]


@pytest.mark.parametrize(("why", "preferences"), BAD, ids=[b[0] for b in BAD])
def test_a_shortlist_breaking_the_contract_is_replaced_by_the_derived_one(
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    why: str,
    preferences: list[Preference],
) -> None:
    """The request is booked where the derived shortlist puts it (the same engine as a
    router giving no shortlist, on a twin fleet with the same loads), the counter
    that /metrics exports goes up by one per request, and each is logged."""

    async def book_four(preferences: list[Preference] | None) -> tuple[list[int], int]:
        state = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await state.start(background=False)
        try:
            shared = routing(state, Listed(preferences))
            # worker 0 (the decision) holds 2 requests more than the view says, so the
            # derived ceilings move the bookings to the others, which a shortlist that
            # listed row 1 first, or counted 5 requests, would not
            ids = shared.ids.to_fleet
            for _ in range(2):
                await state.book(
                    state.new_request_id(), [Candidate(EngineKey(ids[0]))], prefill_tokens=1
                )
            v = View([WorkerView(0), WorkerView(1), WorkerView(2)], BS, CostModel())
            booked = [(await decide(shared, request(i), v))[0] for i in range(4)]
            load = await loads_of(state)
            assert sum(x.in_flight for x in load.values()) == 6
            return booked, shared.bad_shortlists
        finally:
            await state.close()

    async def main() -> None:
        derived, none_bad = await book_four(None)
        assert none_bad == 0
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="quillcache.gateway.shared_routing"):
            got, bad = await book_four(preferences)
        assert got == derived, why
        assert 0 not in got  # the derived ceilings saw worker 0 over its own
        assert bad == 4
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 4, lines
        assert all("'listed'" in m and "derived" in m for m in lines), lines

    run(main())


def test_the_derived_shortlist_gives_terms_for_engines_outside_it() -> None:
    """`build_shortlist`: an engine outside the list is weighed as a listed one other
    than the choice, at the choice's load when the router decided."""
    rows = [WorkerView(w, in_flight=n) for w, n in enumerate([3, 0, 1, 5])]
    v = View(rows, BS, CostModel())
    short = build_shortlist(v, 0, 0, 4, ShortlistPolicy(size=2, cache_slack=2.5))
    assert [c.engine.engine for c in short.candidates] == [0, 1]
    assert short.outside is not None
    assert (short.outside.ceiling, short.outside.credit) == (3 + 1.0, 2.5)


def test_an_engine_outside_the_shortlist_this_replica_cannot_route_to(
    redis_server: RedisServer,
) -> None:
    """Another replica bound the session to an engine this one does not route to (not
    one of its workers): the booking that names it is released and the request is
    booked on the shortlist alone; an engine outside the list that is one of its rows
    is taken."""

    async def main() -> None:
        prefix = fleet()
        other = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        state = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await other.start(background=False)
        await state.start(background=False)
        try:
            shared = routing(state, Listed([Preference(0, 5.0)]), workers=3)
            unknown = EngineKey(12345)
            await other.book(
                other.new_request_id(), [Candidate(unknown)], prefill_tokens=1, session="s"
            )
            v = View([WorkerView(0), WorkerView(1), WorkerView(2)], BS, CostModel())
            assert await decide(shared, request(1, session="s"), v) == (0, 0)
            load = await loads_of(state)
            assert load.get(unknown) is not None and load[unknown].in_flight == 1  # other's
            ids = shared.ids.to_fleet
            assert load[EngineKey(ids[0])].in_flight == 1
            # the session is now bound to worker 0; another replica binds it to worker 2,
            # outside this router's one-row list, and a row of this replica's view
            await other.book(
                other.new_request_id(),
                [Candidate(EngineKey(ids[2]))],
                prefill_tokens=1,
                session="s",
            )
            assert await decide(shared, request(2, session="s"), v) == (2, 0)
            assert shared.moved == 1
            # not a row of the view (unhealthy or draining here): the shortlist's
            await other.book(
                other.new_request_id(),
                [Candidate(EngineKey(ids[2]))],
                prefill_tokens=1,
                session="s",
            )
            v01 = View([WorkerView(0), WorkerView(1)], BS, CostModel())
            assert await decide(shared, request(3, session="s"), v01) == (0, 0)
            await asyncio.sleep(0)
            assert shared.in_flight == 3
        finally:
            await other.close()
            await state.close()

    run(main())
