"""No herding: many bookers on several replicas, each with its own client, book the
same shortlist at once; the per-engine counts are those of one booker in sequence."""

from __future__ import annotations

import asyncio
from collections import Counter

from redis.asyncio import Redis

from quillcache.state import Booked, Candidate, EngineKey, LoadWeights, RedisFleetState, choose
from tests.state.helpers import fleet, run
from tests.state.server import RedisServer

REPLICAS = 4
REQUESTS = 64
# the router's order: engine 0 is where the prefix is best, but it takes only a few
SHORTLIST = [
    Candidate(EngineKey(0), 4),
    Candidate(EngineKey(1), 4),
    Candidate(EngineKey(2, 1), 8),
    Candidate(EngineKey(3), 8),
]


async def _sequential(url: str) -> Counter[EngineKey]:
    s = RedisFleetState(url, prefix=fleet(), budget_s=2.0)
    await s.start(background=False)
    counts: Counter[EngineKey] = Counter()
    for _ in range(REQUESTS):
        out = await s.book(s.new_request_id(), SHORTLIST, prefill_tokens=512)
        assert isinstance(out, Booked)
        counts[out.engine] += 1
    await s.close()
    return counts


async def _concurrent(url: str) -> tuple[Counter[EngineKey], int]:
    prefix = fleet()
    states = [RedisFleetState(url, prefix=prefix, budget_s=5.0) for _ in range(REPLICAS)]
    for s in states:
        await s.start(background=False)
        # every replica's connections are open before the burst
        await asyncio.gather(*(s._client.ping() for _ in range(REQUESTS // REPLICAS)))
    results = await asyncio.gather(
        *(
            s.book(s.new_request_id(), SHORTLIST, prefill_tokens=512)
            for _ in range(REQUESTS // REPLICAS)
            for s in states
        )
    )
    counts: Counter[EngineKey] = Counter()
    shared = 0
    for r in results:
        assert r.engine is not None
        counts[r.engine] += 1
        shared += isinstance(r, Booked)
    in_flight = {k: v.in_flight for k, v in (await states[0].loads()).items()}  # type: ignore[union-attr]
    assert in_flight == dict(counts)
    for s in states:
        await s.close()
    return counts, shared


def test_concurrent_replicas_book_like_one_booker(redis_server: RedisServer) -> None:
    want = run(_sequential(redis_server.url))
    assert want == {EngineKey(0): 14, EngineKey(1): 14, EngineKey(2, 1): 18, EngineKey(3): 18}
    got, shared = run(_concurrent(redis_server.url))
    assert shared == REQUESTS  # every decision was taken in Redis
    for engine in SHORTLIST:
        assert abs(got[engine.engine] - want[engine.engine]) <= 1, (got, want)


async def _naive(url: str) -> Counter[EngineKey]:
    """What the booking script prevents: read the load, choose, then write, in two round
    trips per request (each replica with its own client, as above)."""
    base = "{" + fleet() + "}:"
    clients = [Redis.from_url(url, decode_responses=True) for _ in range(REPLICAS)]

    async def one(c: Redis) -> EngineKey:
        fields = [f"{x.engine.encode()}|n" for x in SHORTLIST]
        vals = await c.hmget(base + "load", fields)
        from quillcache.state import SharedLoad

        loads = {x.engine: SharedLoad(int(v or 0)) for x, v in zip(SHORTLIST, vals, strict=True)}
        i, _ = choose(SHORTLIST, loads, LoadWeights())
        await c.hincrby(base + "load", fields[i], 1)
        return SHORTLIST[i].engine

    got = await asyncio.gather(*(one(c) for _ in range(REQUESTS // REPLICAS) for c in clients))
    for c in clients:
        await c.aclose()
    return Counter(got)


def test_the_herding_test_fails_without_the_script(redis_server: RedisServer) -> None:
    """The check above has teeth: the same burst through read-then-write herds."""
    want = run(_sequential(redis_server.url))
    got = run(_naive(redis_server.url))
    assert any(abs(got[c.engine] - want[c.engine]) > 1 for c in SHORTLIST), got
