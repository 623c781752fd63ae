"""Engines outside the shortlist (docs/state.md, "Outside the shortlist"): the engine a
request's session is bound to and the engines computing the request's prefix are
candidates of the booking even when the router did not list them, weighed by the
shortlist's `OutsideTerms`. The script in a real server against its Python reference
(`choose`, `outsiders`), over random fleets built by another replica's bookings."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from quillcache.state import (
    Booked,
    Candidate,
    Computing,
    EngineKey,
    LoadWeights,
    OutsideTerms,
    RedisFleetState,
    SharedLoad,
    choose,
    outsiders,
)
from tests.state.helpers import fleet, loads_of, run
from tests.state.server import RedisServer

# numeric order differs from the keys' text order ("10:0" < "9:0"), and a 48-bit id
ENGINES = [
    EngineKey(9),
    EngineKey(10),
    EngineKey(10, 1),
    EngineKey(2**47 + 5),
    EngineKey(3),
    EngineKey(100),
]
WEIGHTS = [LoadWeights(), LoadWeights(1.0, 0.01, 0.5)]
# the request: 16 blocks of 16 tokens and 5 of its own; its anchors at 4, 8, 16 blocks
ANCHORS = [(0xA1, 4), (0xA2, 8), (0xA3, 16)]
PROMPT, BS, PREFILL = 16 * 16 + 5, 16, 7
SESSION = "a-session"

engine_ix = st.integers(0, len(ENGINES) - 1)
listed = st.lists(
    st.tuples(
        engine_ix,
        st.sampled_from([0.0, 0.0, 1.0, 1.0, 2.5, 4.0, math.inf]),
        st.sampled_from([0.0, 1.5, 3.0]),
        st.one_of(st.none(), st.integers(0, 16)),
    ),
    min_size=1,
    max_size=4,
    unique_by=lambda t: t[0],
)
some_terms = st.builds(
    OutsideTerms, st.sampled_from([0.0, 1.0, 2.5, 5.0]), st.sampled_from([0.0, 2.0, 4.0])
)
terms = st.one_of(st.none(), some_terms, some_terms)
fleets = st.fixed_dictionaries(
    {
        "loads": st.lists(st.integers(0, 4), min_size=len(ENGINES), max_size=len(ENGINES)),
        "session": st.one_of(st.none(), engine_ix, engine_ix),
        "placements": st.lists(st.tuples(engine_ix, st.integers(1, 3)), max_size=4),
        "draining": st.sets(engine_ix, max_size=2),
    }
)


def expected_prefill(c: Candidate, pending: dict[EngineKey, Computing]) -> int:
    """What the script books: the prompt beyond what the chosen engine holds or is
    computing, when its held blocks are known; else the replica's figure."""
    if c.cached_blocks is None:
        return PREFILL
    return max(PROMPT - max(c.cached_blocks, pending.get(c.engine, Computing(0)).blocks) * BS, 1)


async def _check(
    url: str,
    shortlist: list[Candidate],
    outside: OutsideTerms | None,
    weights: LoadWeights,
    world: dict[str, object],
    with_session: bool,
) -> None:
    prefix = fleet()
    a = RedisFleetState(url, prefix=prefix, budget_s=1.0)  # the other replicas
    b = RedisFleetState(url, prefix=prefix, budget_s=1.0)  # the one booking
    await a.start(background=False)
    await b.start(background=False)
    try:
        loads = world["loads"]
        assert isinstance(loads, list)
        for e, n in zip(ENGINES, loads, strict=True):
            for j in range(n):
                rid = a.new_request_id()
                await a.book(rid, [Candidate(e)], prefill_tokens=10 * (j + 1), context_tokens=50)
                if j % 2:
                    await a.prefill_done(rid)
        session = world["session"]
        if isinstance(session, int):
            await a.book(
                a.new_request_id(), [Candidate(ENGINES[session])], prefill_tokens=1, session=SESSION
            )
        placements = world["placements"]
        assert isinstance(placements, list)
        for i, k in placements:
            await a.book(
                a.new_request_id(),
                [Candidate(ENGINES[i])],
                prefill_tokens=1,
                anchors=ANCHORS[:k],
                spec_ttl_s=60,
            )
        draining = world["draining"]
        assert isinstance(draining, set)
        for i in draining:
            await a.set_draining(ENGINES[i])
        before: dict[EngineKey, SharedLoad] = await loads_of(b)
        pending = await b.pending(ANCHORS)
        assert isinstance(pending, dict)
        bound = await b.session(SESSION) if with_session else None
        assert bound is None or isinstance(bound, EngineKey)
        off = {ENGINES[i] for i in draining}
        want, reason = choose(
            shortlist,
            before,
            weights,
            session_engine=bound,
            pending=pending,
            request_blocks=16,
            outside=outside,
            draining=off,
        )
        cands = [
            *shortlist,
            *outsiders(shortlist, outside, session_engine=bound, pending=pending, draining=off),
        ]
        got = await b.book(
            b.new_request_id(),
            shortlist,
            prefill_tokens=PREFILL,
            weights=weights,
            session=SESSION if with_session else None,
            anchors=ANCHORS,
            spec_ttl_s=60,
            prompt_tokens=PROMPT,
            block_size=BS,
            outside=outside,
        )
        assert isinstance(got, Booked), got
        event(f"{reason}, {'outside' if want >= len(shortlist) else 'listed'}")
        where = (shortlist, outside, before, pending, bound, off)
        assert (got.engine, got.reason) == (cands[want].engine, reason), where
        assert got.index == (want if want < len(shortlist) else -1), where
        assert got.prefill_tokens == expected_prefill(cands[want], pending), where
    finally:
        await a.close()
        await b.close()


@settings(
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    deadline=None,
)
@given(
    rows=listed,
    outside=terms,
    weights=st.sampled_from(WEIGHTS),
    world=fleets,
    with_session=st.sampled_from([True, True, False]),
)
def test_the_script_weighs_engines_outside_the_shortlist_as_choose_does(
    redis_server: RedisServer,
    rows: list[tuple[int, float, float, int | None]],
    outside: OutsideTerms | None,
    weights: LoadWeights,
    world: dict[str, object],
    with_session: bool,
) -> None:
    shortlist = [Candidate(ENGINES[i], c, cr, held) for i, c, cr, held in rows]
    run(_check(redis_server.url, shortlist, outside, weights, world, with_session))


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_a_bound_engine_and_a_prefix_being_computed_outside_the_shortlist(
    redis_server: RedisServer, fast_path: bool
) -> None:
    """Replica `a` bound two sessions to engine 7 and is computing a 16-block prefix on
    engine 8; replica `b`'s router listed neither. Without outside terms (the rule
    before) the booking never leaves the shortlist. With them it takes the bound engine
    while it is under `ceiling + credit`, then the engine computing the prefix while
    under `ceiling + credit * part` (to which the session is then bound), then the
    shortlist again."""

    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0, fast_path=fast_path)
        await a.start(background=False)
        await b.start(background=False)
        e1, e2, bound, computing = EngineKey(1), EngineKey(2), EngineKey(7), EngineKey(8)
        try:
            for session in (SESSION, "another-session"):
                await a.book(
                    a.new_request_id(), [Candidate(bound)], prefill_tokens=1, session=session
                )
            await a.book(
                a.new_request_id(),
                [Candidate(computing)],
                prefill_tokens=1,
                anchors=ANCHORS,
                spec_ttl_s=60,
            )
            listed = [Candidate(e1, 1.0), Candidate(e2, 1.0)]

            async def book(session: str, outside: OutsideTerms | None) -> Booked:
                out = await b.book(
                    b.new_request_id(),
                    listed,
                    prefill_tokens=PREFILL,
                    session=session,
                    anchors=ANCHORS,
                    spec_ttl_s=60,
                    prompt_tokens=PROMPT,
                    block_size=BS,
                    outside=outside,
                )
                assert isinstance(out, Booked), out
                return out

            old = await book("another-session", None)  # engine 7 bound, 8 computing
            assert (old.engine, old.reason, old.index) == (e1, "under", 0)
            # loads 7: 2, 8: 1, 1: 1. The bound engine until 5 >= 2.5 + 2.0; then the
            # engine computing the prefix (1 < 2.5 + 2.0 * 16/16), bound from then on
            # until it too has 5; then engine 2, the first listed under its ceiling
            terms = OutsideTerms(2.5, 2.0)
            got = [await book(SESSION, terms) for _ in range(8)]
            assert [(g.engine, g.reason) for g in got] == [
                *[(bound, "session")] * 3,
                (computing, "pending"),
                *[(computing, "session")] * 3,
                (e2, "under"),
            ]
            assert [g.index for g in got] == [-1] * 7 + [1]
            # what the bound engine holds is not known (all the prompt is booked); the
            # engine computing the prefix gets the rest of the prompt
            assert got[0].prefill_tokens == PROMPT
            assert got[3].prefill_tokens == PROMPT - 16 * BS
            load = await loads_of(b)
            assert (load[bound].in_flight, load[computing].in_flight) == (5, 5)
        finally:
            await a.close()
            await b.close()

    run(main())
