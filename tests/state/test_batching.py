"""The request ends (releases, prefills done) are batched: queued, they ride on the
replica's next booking or go as one batch `settle_s` later, so a routed request costs
one round trip (issue 16: "at most one round trip per routed request"). Round trips
are counted by the server itself (`INFO commandstats`)."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from quillcache.state import Booked, EngineKey, RedisFleetState, SharedLoad
from tests.state.helpers import fleet, loads_of, run, shortlist
from tests.state.server import RedisServer

# a queued request's attention pairs, by hand: n new tokens after c cached ones attend to
# the c and to the new ones up to themselves, n * (c + (n + 1) / 2)
PAIRS_7_OF_9 = 7 * (2 + 4)  # 7 new of a 9-token prompt
PAIRS_5_OF_11 = 5 * (6 + 3)


async def script_calls(url: str) -> int:
    """EVALSHA + EVAL calls the server has answered so far."""
    client = Redis.from_url(url)
    try:
        stats = await client.info("commandstats")
    finally:
        await client.aclose()
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


def test_one_round_trip_per_request_the_ends_ride_on_bookings(redis_server: RedisServer) -> None:
    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0, settle_s=3600.0)
        await s.start(background=False)
        try:
            # every script cached in Redis (a NOSCRIPT reply and its EVAL are two calls)
            await s.book("warm", shortlist(1e9), prefill_tokens=1)
            await s.release("warm")
            before = await script_calls(redis_server.url)
            for _ in range(100):
                rid = s.new_request_id()
                out = await s.book(rid, shortlist(1e9), prefill_tokens=7, context_tokens=9)
                assert isinstance(out, Booked)
                assert s.prefill_done_soon(rid) and not s.prefill_done_soon(rid)
                assert s.release_soon(rid) and not s.release_soon(rid)
            assert await script_calls(redis_server.url) - before == 100
            # the last request's end is still queued: its load is in Redis until sent
            assert await loads_of(s) == {EngineKey(0): SharedLoad(1, 7, 0, 0, PAIRS_7_OF_9)}
            await s.flush()
            assert await loads_of(s) == {}
            # one release per request; its prefill, queued with it, was not sent
            st = s.stats
            assert (st.ends_sent, st.ends_applied, st.ends_unknown) == (101, 101, 0)
            assert st.end_batches == 2
        finally:
            await s.close()

    run(main())


def test_a_batch_goes_on_its_own_after_settle_s(redis_server: RedisServer) -> None:
    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0, settle_s=0.05)
        await s.start(background=False)
        try:
            rids = [s.new_request_id() for _ in range(4)]
            for rid in rids:
                await s.book(rid, shortlist(1e9), prefill_tokens=5, context_tokens=11)
            await s.release(rids.pop())  # every script cached in Redis: no NOSCRIPT below
            assert await loads_of(s) == {EngineKey(0): SharedLoad(3, 15, 0, 0, 3 * PAIRS_5_OF_11)}
            before = await script_calls(redis_server.url)
            s.prefill_done_soon(rids[0])
            s.release_soon(rids[1])
            await asyncio.sleep(0.01)
            assert await script_calls(redis_server.url) == before  # not sent yet
            await asyncio.sleep(0.3)
            assert await script_calls(redis_server.url) - before == 1  # both in one script
            assert await loads_of(s) == {EngineKey(0): SharedLoad(2, 5, 1, 11, PAIRS_5_OF_11)}
            assert s.stats.end_batches == 2 and s.stats.ends_applied == 3
        finally:
            await s.close()

    run(main())


def test_a_resync_takes_the_queue_from_the_book(redis_server: RedisServer) -> None:
    """Queued ends are in the replica's book already: a resync writes the book and the
    queue goes with it (sent afterwards, Redis would find them unknown)."""

    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0, settle_s=3600.0)
        await s.start(background=False)
        try:
            rids = [s.new_request_id() for _ in range(3)]
            for rid in rids:
                await s.book(rid, shortlist(1e9), prefill_tokens=5)
            s.release_soon(rids[0])
            s.release_soon(rids[1])
            waiting = asyncio.ensure_future(s.release(rids[2]))
            assert await s.resync()
            assert (await waiting).detail in ("ok", "resynced")
            await s.flush()
            assert await loads_of(s) == {}
            assert s.stats.ends_unknown == 0
        finally:
            await s.close()

    run(main())
