"""The shared state's operations, one round trip each, against a real server."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.secret import GatewaySecret
from quillcache.state import (
    Booked,
    Candidate,
    Computing,
    EngineKey,
    LoadWeights,
    LocalFallback,
    PinRecord,
    RedisFleetState,
    SecretMismatchError,
    Shared,
    SharedLoad,
    StateError,
    choose,
)
from tests.state.helpers import fleet, in_flight, loads_of, run, shortlist
from tests.state.server import RedisServer


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_book_prefill_release_round_trips(
    redis_server: RedisServer, fast_path: bool, loop: str
) -> None:
    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0, fast_path=fast_path)
        await s.start(background=False)
        try:
            rid = s.new_request_id()
            out = await s.book(rid, shortlist(2, 2), prefill_tokens=300, context_tokens=500)
            assert isinstance(out, Booked) and out.engine == EngineKey(0) and out.reason == "under"
            assert out.loads == (SharedLoad(), SharedLoad())
            assert await loads_of(s) == {
                EngineKey(0): SharedLoad(1, 300, 0, 0, 300 * (200 + 150.5))
            }
            assert await s.prefill_done(rid) == Shared("ok")
            assert await loads_of(s) == {EngineKey(0): SharedLoad(1, 0, 1, 500)}
            assert await s.prefill_done(rid) == Shared("already prefilled")
            # a second booking sees the first one's load
            rid2 = s.new_request_id()
            out2 = await s.book(rid2, shortlist(1, 5), prefill_tokens=10)
            assert isinstance(out2, Booked) and out2.engine == EngineKey(1)
            assert out2.loads[0] == SharedLoad(1, 0, 1, 500)
            # booking the same id again books nothing more
            again = await s.book(rid2, shortlist(1, 5), prefill_tokens=10)
            assert isinstance(again, Booked) and again.reason == "retry"
            assert again.engine == EngineKey(1)
            assert await s.release(rid) == Shared("ok")
            assert await s.release(rid) == Shared("unknown request")
            assert await loads_of(s) == {
                EngineKey(1): SharedLoad(1, 10, 0, 0, 10 * 5.5)
            }  # no prompt: no context
            assert await s.release(rid2) == Shared("ok")
            assert await loads_of(s) == {}
            assert s.stats.booked == 2 and not s.stats.fallbacks
        finally:
            await s.close()

    run(main(), loop=loop)


def test_dp_ranks_are_separate_rows(redis_server: RedisServer) -> None:
    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await s.start(background=False)
        try:
            ranks = [Candidate(EngineKey(7, r), 1) for r in range(3)]
            got = [await s.book(s.new_request_id(), ranks, prefill_tokens=1) for _ in range(3)]
            assert [g.engine for g in got] == [EngineKey(7, 0), EngineKey(7, 1), EngineKey(7, 2)]
            assert set(await loads_of(s)) == {EngineKey(7, r) for r in range(3)}
        finally:
            await s.close()

    run(main())


def test_every_replica_sees_the_others_bookings(redis_server: RedisServer) -> None:
    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        try:
            ra, rb = a.new_request_id(), b.new_request_id()
            assert ra != rb and ra.startswith(a.replica) and rb.startswith(b.replica)
            assert isinstance(await a.book(ra, shortlist(1, 1), prefill_tokens=5), Booked)
            out = await b.book(rb, shortlist(1, 1), prefill_tokens=5)
            assert isinstance(out, Booked) and out.engine == EngineKey(1)  # 0 is full
            assert in_flight(await loads_of(b)) == {0: 1, 1: 1}
            # releasing through the other replica does nothing: bookings are per lease
            assert await b.release(ra) == Shared("unknown request")
            await a.close()  # leave: its share goes now
            assert in_flight(await loads_of(b)) == {1: 1}
        finally:
            await b.close()

    run(main())


def test_choice_rule_matches_python(redis_server: RedisServer) -> None:
    """The script's choice equals `choose` over the same loads: every candidate over
    its ceiling -> least overshoot; weights count queued tokens and decodes."""

    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await s.start(background=False)
        w = LoadWeights(in_flight=1.0, queued_tokens=0.01, decodes=0.5)
        try:
            cands = [Candidate(EngineKey(i), c) for i, c in enumerate([3.0, 0.0, 6.5, 2.0])]
            for k in range(40):
                rid = s.new_request_id()
                before = await loads_of(s)
                want, reason = choose(cands, before, w)
                got = await s.book(rid, cands, prefill_tokens=37 * (k % 5), weights=w)
                assert isinstance(got, Booked)
                assert (got.index, got.reason) == (want, reason), k
                if k % 3 == 0:
                    await s.prefill_done(rid)
                if k % 7 == 0:
                    await s.release(rid)
        finally:
            await s.close()

    run(main())


def test_a_prefix_being_computed_raises_the_ceiling_by_its_credit(
    redis_server: RedisServer,
) -> None:
    """`Candidate.credit`: where the request's prefix is being computed, the candidate
    is preferred up to its ceiling plus the credit times the part being computed; the
    script's choice equals `choose` with the same pending blocks, over random
    shortlists, loads and prefixes."""

    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        rng = random.Random(7)
        w = LoadWeights()
        try:
            # engine 1 computes a 16-block prefix and has 3 requests in flight
            for k in range(3):
                await a.book(
                    a.new_request_id(),
                    [Candidate(EngineKey(1), 10)],
                    prefill_tokens=64,
                    anchors=[(0xA1, 8), (0xA2, 16)] if k == 0 else [],
                )
            whole = [(0xA1, 8), (0xA2, 16)]
            half = [(0xA1, 8), (0xB2, 16)]  # only its first 8 blocks are being computed
            over = [Candidate(EngineKey(0), 1.0), Candidate(EngineKey(1), 2.0, 2.0)]
            got = await b.book(b.new_request_id(), over, prefill_tokens=64, anchors=whole)
            assert isinstance(got, Booked) and (got.engine, got.reason) == (
                EngineKey(1),
                "pending",
            )  # 3 in flight < 2 + 2 * 16/16
            got = await b.book(b.new_request_id(), over, prefill_tokens=64, anchors=half)
            assert isinstance(got, Booked) and (got.engine, got.reason) == (
                EngineKey(0),
                "under",
            )  # 4 in flight >= 2 + 2 * 8/16: engine 0 (0 in flight) is under its 1
            for k in range(40):
                cands = [
                    Candidate(EngineKey(e), rng.choice([0.0, 1.0, 3.0, 6.0]), rng.random() * 6)
                    for e in rng.sample(range(3), rng.randint(1, 3))
                ]
                anchors = rng.choice([whole, half, [(0xC1, 4)]])
                before = await loads_of(b)
                pending = await b.pending(anchors)
                want = choose(
                    cands,
                    before,
                    w,
                    pending=pending,
                    request_blocks=max(n for _, n in anchors),
                )
                rid = b.new_request_id()
                got = await b.book(rid, cands, prefill_tokens=8, anchors=anchors, spec_ttl_s=60)
                assert isinstance(got, Booked)
                assert (got.index, got.reason) == want, (k, cands, before, pending)
                if k % 2:
                    await b.release(rid)
        finally:
            await a.close()
            await b.close()

    run(main())


def test_engines_computing_the_same_depth_are_taken_in_the_order_first_placed(
    redis_server: RedisServer,
) -> None:
    """A prefix that overflowed once to a second engine keeps following the first one
    it was placed on, whatever each replica's shortlist order: replicas whose routers
    list the two engines in opposite orders book the same engine, and the second one
    only once the first is over its ceiling plus credit. A booking moves an engine's
    deadline on without moving it in the order; when the first placement lapses, the
    second engine is first."""

    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        anchors = [(0xD1, 8), (0xD2, 16)]
        first, second = EngineKey(5), EngineKey(2)  # text and numeric order: 2 first
        try:
            await a.book(
                a.new_request_id(),
                [Candidate(first, 10)],
                prefill_tokens=1,
                anchors=anchors,
                spec_ttl_s=0.4,
            )
            await a.book(
                a.new_request_id(),
                [Candidate(second, 10)],
                prefill_tokens=1,
                anchors=anchors,
                spec_ttl_s=60,
            )
            assert await b.pending(anchors) == {first: Computing(16, 0), second: Computing(16, 1)}
            for order in ([second, first], [first, second]):
                got = await b.book(
                    b.new_request_id(),
                    [Candidate(e, 1.0, 4.0) for e in order],
                    prefill_tokens=1,
                    anchors=anchors,
                    spec_ttl_s=0.4,
                )
                assert isinstance(got, Booked) and (got.engine, got.reason) == (first, "pending")
            # 3 in flight on the first: at its ceiling 1 + credit 2, the second is taken
            got = await b.book(
                b.new_request_id(),
                [Candidate(e, 1.0, 2.0) for e in (first, second)],
                prefill_tokens=1,
                anchors=anchors,
                spec_ttl_s=60,
            )
            assert isinstance(got, Booked) and (got.engine, got.reason) == (second, "pending")
            # that booking moved the second's deadline on, not its place
            assert (await b.pending(anchors))[second] == Computing(16, 1)
            await asyncio.sleep(0.5)  # the first placement lapses
            assert await b.pending(anchors) == {second: Computing(16, 0)}
        finally:
            await a.close()
            await b.close()

    run(main())


def test_anchor_tails_find_the_shared_depth_between_anchors(redis_server: RedisServer) -> None:
    """Two prompts of 41 blocks sharing their first 40: the deepest shared anchor is at
    32, and the first request's tail there says the two stay equal to block 40, on the
    engine it was placed on only. The follower books its prefill beyond 40 blocks
    there, not beyond 32 (four-replica burst, docs/results/state.md, cause 3)."""
    import numpy as np

    from quillcache.state.shortlist import anchors as anchors_of

    shared = np.arange(1, 41, dtype=np.uint64) * np.uint64(0x9E3779B1)
    first_keys = np.append(shared, np.uint64(0xAAAA0001))
    second_keys = np.append(shared, np.uint64(0xBBBB0002))
    first_anchors, second_anchors = anchors_of(first_keys), anchors_of(second_keys)
    assert [a.blocks for a in second_anchors] == [1, 2, 4, 8, 16, 32, 41]
    bs, prompt = 16, 41 * 16 - 3
    writer, other = EngineKey(3), EngineKey(1)

    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        try:
            await a.book(
                a.new_request_id(),
                [Candidate(writer, 100, 0.0, 0)],
                prefill_tokens=prompt,
                anchors=first_anchors,
                prompt_tokens=prompt,
                block_size=bs,
                spec_ttl_s=0.5,
            )
            # a third request on another engine shares the anchors up to 32 only
            await a.book(
                a.new_request_id(),
                [Candidate(other, 100, 0.0, 0)],
                prefill_tokens=prompt,
                anchors=second_anchors[:6],
                spec_ttl_s=60,
            )
            assert await b.pending(second_anchors) == {
                writer: Computing(40, 0),
                other: Computing(32, 1),
            }
            # without tails (pairs), both are at the anchor's depth
            pairs = [(x.key, x.blocks) for x in second_anchors]
            assert await b.pending(pairs) == {writer: Computing(32, 0), other: Computing(32, 1)}
            got = await b.book(
                b.new_request_id(),
                [Candidate(other, 100, 1.0, 0), Candidate(writer, 100, 1.0, 0)],
                prefill_tokens=prompt,
                anchors=second_anchors,
                prompt_tokens=prompt,
                block_size=bs,
                spec_ttl_s=60,
            )
            assert isinstance(got, Booked)
            assert (got.engine, got.reason, got.prefill_tokens) == (
                writer,
                "pending",
                prompt - 40 * bs,
            )
            # a booking on the writer's engine moves its deadline on and keeps the tail
            assert (await b.pending(first_anchors))[writer] == Computing(41, 0)
        finally:
            await a.close()
            await b.close()

    async def lapsed() -> None:
        # the writer's placement lapses: the tail becomes the next booking's
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        try:
            for engine, keys, ttl in ((writer, first_keys, 0.3), (other, second_keys, 60)):
                await a.book(
                    a.new_request_id(),
                    [Candidate(engine, 100, 0.0, 0)],
                    prefill_tokens=prompt,
                    anchors=anchors_of(keys),
                    spec_ttl_s=ttl,
                )
                await asyncio.sleep(0.4)
            assert await a.pending(first_anchors) == {other: Computing(40, 0)}
        finally:
            await a.close()

    run(main())
    run(lapsed())


def test_a_fresh_placement_is_not_written_again(redis_server: RedisServer) -> None:
    """A booking on an engine whose placement of an anchor has more than 3/4 of the TTL
    left writes nothing there (a burst on one prefix writes its anchors about once per
    quarter TTL); an older one is moved on; a new engine is added after the others."""
    from redis.asyncio import Redis

    now = [1_000_000]
    ttl_s = 4.0

    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0, clock=lambda: now[0])
        raw = Redis.from_url(redis_server.url, decode_responses=True)
        await s.start(background=False)
        key = f"{s.base}spc:{0xA1:016x}"

        async def book(engine: int) -> None:
            got = await s.book(
                s.new_request_id(),
                [Candidate(EngineKey(engine), 100)],
                prefill_tokens=8,
                anchors=[(0xA1, 8)],
                spec_ttl_s=ttl_s,
            )
            assert isinstance(got, Booked)

        async def members() -> str:
            value = await raw.get(key)
            assert value is not None
            return str(value).split("|", 1)[1]

        try:
            await book(3)
            assert await members() == "3:0=1004000"
            now[0] += 900  # 3.1 s of 4 left: fresh
            await book(3)
            assert await members() == "3:0=1004000"
            now[0] += 200  # 2.9 s left: moved on
            await book(3)
            assert await members() == "3:0=1005100"
            now[0] += 100
            await book(5)  # another engine: always written, after the first
            assert await members() == "3:0=1005100,5:0=1005200"
        finally:
            await s.close()
            await raw.aclose()

    run(main())


def test_the_prefill_booked_is_the_prompt_beyond_what_the_engine_holds_or_computes(
    redis_server: RedisServer,
) -> None:
    """With the prompt, the block size and each candidate's held blocks, the script
    books the prompt beyond the longer of what the chosen engine holds and what of the
    request is being computed there; the replica's own book follows the script."""

    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await s.start(background=False)
        try:
            anchors = [(0xA1, 8), (0xA2, 16), (0xA3, 20)]
            first = await s.book(
                s.new_request_id(),
                [Candidate(EngineKey(0), 10, 0.0, 0)],
                prefill_tokens=999,
                anchors=anchors,
                prompt_tokens=330,
                block_size=16,
            )
            assert isinstance(first, Booked) and first.prefill_tokens == 330
            # another request sharing 16 blocks of it: engine 0 computes those
            rid = s.new_request_id()
            second = await s.book(
                rid,
                [Candidate(EngineKey(1), 10, 0.0, 2), Candidate(EngineKey(0), 10, 5.0, 0)],
                prefill_tokens=999,
                anchors=[(0xA1, 8), (0xA2, 16), (0xB3, 20)],
                prompt_tokens=330,
                block_size=16,
            )
            assert isinstance(second, Booked)
            assert (second.engine, second.reason, second.prefill_tokens) == (
                EngineKey(0),
                "pending",
                330 - 16 * 16,
            )
            assert (await loads_of(s))[EngineKey(0)].queued_prefill_tokens == 330 + 74
            # without the prompt the replica's figure is booked, as before
            third = await s.book(
                s.new_request_id(), [Candidate(EngineKey(2), 10)], prefill_tokens=77
            )
            assert isinstance(third, Booked) and third.prefill_tokens == 77
            await s.release(rid)
            assert (await loads_of(s))[EngineKey(0)].queued_prefill_tokens == 330
        finally:
            await s.close()

    run(main())


def test_session_binding_and_pending_placement(redis_server: RedisServer) -> None:
    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        try:
            # a routes a new prefix (anchors at 4 and 8 blocks) to engine 2
            first = await a.book(
                a.new_request_id(),
                [Candidate(EngineKey(2), 10), Candidate(EngineKey(0), 10)],
                prefill_tokens=128,
                anchors=[(0xAB, 4), (0xCD, 8)],
                session="conversation-1",
            )
            assert isinstance(first, Booked) and first.engine == EngineKey(2)
            assert await b.pending([(0xAB, 4), (0xCD, 8), (0xEF, 16)]) == {
                EngineKey(2): Computing(8)
            }
            assert await b.session("conversation-1") == EngineKey(2)
            # b's router prefers engine 0, but engine 2 is computing this prefix
            same = await b.book(
                b.new_request_id(),
                shortlist(10, 10, 10),
                prefill_tokens=128,
                anchors=[(0xAB, 4), (0xCD, 8)],
            )
            assert isinstance(same, Booked) and (same.engine, same.reason) == (
                EngineKey(2),
                "pending",
            )
            # ... not when it is at its ceiling there
            full = await b.book(
                b.new_request_id(),
                [Candidate(EngineKey(0), 10), Candidate(EngineKey(2), 2)],
                prefill_tokens=128,
                anchors=[(0xAB, 4)],
            )
            assert isinstance(full, Booked) and (full.engine, full.reason) == (
                EngineKey(0),
                "under",
            )
            # the session goes back to its engine, ahead of the router's order
            back = await b.book(
                b.new_request_id(),
                [Candidate(EngineKey(1), 10), Candidate(EngineKey(2), 10)],
                prefill_tokens=16,
                session="conversation-1",
            )
            assert isinstance(back, Booked) and (back.engine, back.reason) == (
                EngineKey(2),
                "session",
            )
            assert await b.session("no such session") is None
            # speculative placements lapse with their TTL
            await a.book(
                a.new_request_id(),
                shortlist(10),
                prefill_tokens=1,
                anchors=[(0x11, 2)],
                spec_ttl_s=0.05,
            )
            assert await a.pending([(0x11, 2)]) == {EngineKey(0): Computing(2)}
            await asyncio.sleep(0.12)
            assert await a.pending([(0x11, 2)]) == {}
        finally:
            await a.close()
            await b.close()

    run(main())


def test_pins_draining_engines_config(redis_server: RedisServer) -> None:
    async def main() -> None:
        prefix = fleet()
        a = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        b = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await a.start(background=False)
        await b.start(background=False)
        try:
            c0 = await b.config()
            assert not isinstance(c0, LocalFallback) and c0.version == 0
            p = await a.pin(0xFEED, "tenant-a", ttl_s=0.3)
            assert not isinstance(p, LocalFallback) and p.pinned
            taken = await b.pin(0xFEED, "tenant-b", ttl_s=5)
            assert not isinstance(taken, LocalFallback) and not taken.pinned
            assert taken.owner == "tenant-a"
            assert await a.set_draining(EngineKey(3, 1)) == Shared("changed")
            assert await a.set_draining(EngineKey(3, 1)) == Shared("unchanged")
            assert await a.add_engine(12, {"url": "http://127.0.0.1:9"}) == Shared("changed")
            # what warming it takes, for every replica (a malformed record is skipped)
            record = PinRecord("m", "salt-1", [1, 2, 3])
            assert await a.put_pin_record(0xFEED, record) == Shared()
            assert await a.put_pin_chain(0xFEED, [0xAA, 0xFEED]) == Shared()
            assert await b.pin_records([0xFEED, 0xBEEF]) == {0xFEED: record}
            # the TTL left, by Redis's clock, as any replica reads it (0xBEEF: not pinned)
            ttls = await b.pin_ttls([0xFEED, 0xBEEF])
            assert not isinstance(ttls, LocalFallback) and set(ttls) == {0xFEED}
            assert 0.0 < ttls[0xFEED] <= 0.3
            c1 = await b.config()
            assert not isinstance(c1, LocalFallback)
            assert c1.engines == {12: {"url": "http://127.0.0.1:9"}}
            assert c1.draining == frozenset({EngineKey(3, 1)})
            assert c1.pins == {0xFEED: "tenant-a"}
            assert c1.version > c0.version
            await asyncio.sleep(0.4)  # the pin lapses
            c2 = await b.config()
            assert not isinstance(c2, LocalFallback) and c2.pins == {} and c2.version > c1.version
            assert await b.pin_ttls([0xFEED]) == {}
            # a lapsed pin's chain and record go with it
            assert await b.pin_records([0xFEED]) == {}
            assert await b.pin_chains([0xFEED]) == {}
            await a.set_draining(EngineKey(3, 1), False)
            await a.remove_engine(12)
            c3 = await b.config()
            assert not isinstance(c3, LocalFallback)
            assert (c3.engines, c3.draining) == ({}, frozenset())
            unpinned = await b.unpin(0xFEED, "tenant-b")
            assert not isinstance(unpinned, LocalFallback) and not unpinned.pinned
        finally:
            await a.close()
            await b.close()

    run(main())


def test_noscript_falls_back_to_eval(redis_server: RedisServer) -> None:
    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await s.start(background=False)
        try:
            await s._client.execute_command("SCRIPT", "FLUSH")
            out = await s.book(s.new_request_id(), shortlist(5), prefill_tokens=1)
            assert isinstance(out, Booked)
            info = await s._client.execute_command("INFO", "commandstats")
            assert info["cmdstat_evalsha"]["failed_calls"] >= 1  # NOSCRIPT
            assert info["cmdstat_eval"]["calls"] >= 1
        finally:
            await s.close()

    run(main())


async def _keyspace_calls(s: RedisFleetState) -> int:
    """The commands Redis ran since the last reset, but the scripts themselves and the
    test's own reads of the counters."""
    info = await s._client.execute_command("INFO", "commandstats")
    skip = ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_info", "cmdstat_config|resetstat")
    return sum(int(v["calls"]) for k, v in info.items() if k not in skip)


@pytest.mark.parametrize("ends", [1, 12])
def test_a_booking_makes_few_keyspace_calls(redis_server: RedisServer, ends: int) -> None:
    """The booking script batches: its keyspace calls grow with the anchors (at most one
    write each), not with the candidates or with the request ends riding on it (one call for
    a batch's records, one HMGET and one HSET for every load field it changes)."""

    async def main() -> None:
        s = RedisFleetState(redis_server.url, prefix=fleet(), budget_s=1.0)
        await s.start(background=False)
        try:
            anchors = [(0x100 + a, 1 << a) for a in range(4)]
            rids: list[str] = []
            for i in range(4 * ends):  # bookings for the ends to release below
                rid = s.new_request_id()
                out = await s.book(rid, shortlist(2, 2, 2, 2), prefill_tokens=8, session="s")
                assert isinstance(out, Booked)
                rids.append(rid)
                if i % 2:
                    s.prefill_done_soon(rid)
            await s.flush()
            await s._client.execute_command("CONFIG", "RESETSTAT")
            bookings = 4
            for _ in range(bookings):
                for _ in range(ends):
                    assert s.release_soon(rids.pop())
                out = await s.book(
                    s.new_request_id(),
                    shortlist(2, 2, 2, 2),
                    prefill_tokens=8,
                    anchors=anchors,
                    session="s",
                )
                assert isinstance(out, Booked)
            per_booking = await _keyspace_calls(s) / bookings
            # the lease (TIME, reap, renew), the records (HMGET, HSET, HDEL), the load
            # (HMGET, HSET, HDEL), the anchors (MGET + at most one SET each: none where
            # the engine's placement is fresh), the session (GET, SET)
            assert per_booking <= 11 + len(anchors), per_booking
            assert sum(v.in_flight for v in (await loads_of(s)).values()) == len(rids) + bookings
        finally:
            await s.close()

    run(main())


def _secret(key: bytes, previous: bytes | None = None, window_s: float = 3600.0) -> GatewaySecret:
    return GatewaySecret(key * 32, previous * 32 if previous else None, time.time() + window_s)


def test_secret_fingerprint_refusal(redis_server: RedisServer) -> None:
    async def start(prefix: str, secret: GatewaySecret) -> RedisFleetState:
        s = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
        await s.start(secret, background=False)
        return s

    async def main() -> None:
        prefix = fleet()
        a = await start(prefix, _secret(b"a"))
        with pytest.raises(SecretMismatchError) as err:
            await start(prefix, _secret(b"b"))
        msg = str(err.value)
        assert "same secret file" in msg and _secret(b"a").fingerprint in msg
        assert _secret(b"a").current.hex() not in msg
        assert isinstance(err.value, ConfigError)
        # Redis holds the fingerprint, never the secret
        meta = await a._client.hgetall("{" + prefix + "}:meta")
        assert _secret(b"a").current.hex() not in str(meta)
        assert meta["secret_fp"] == _secret(b"a").fingerprint
        # the same secret joins; another fleet (prefix) may use another secret
        await (await start(prefix, _secret(b"a"))).close()
        await (await start(fleet(), _secret(b"b"))).close()
        # a rotation: the new secret whose previous one is the fleet's is accepted and
        # becomes the fleet's; a replica not yet restarted is accepted in the window
        rotated = await start(prefix, _secret(b"c", previous=b"a"))
        await (await start(prefix, _secret(b"a"))).close()
        with pytest.raises(SecretMismatchError):
            await start(prefix, _secret(b"d"))
        await rotated.close()
        await a.close()

    async def expired_window() -> None:
        # a previous secret past its window is not accepted
        prefix = fleet()
        await (await start(prefix, _secret(b"f"))).close()
        with pytest.raises(SecretMismatchError):
            await start(prefix, _secret(b"e", previous=b"f", window_s=-1))
        await (await start(prefix, _secret(b"e", previous=b"f"))).close()  # within it: yes

    run(main())
    run(expired_window())


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        RedisFleetState(prefix="a{b}")
    with pytest.raises(ConfigError):
        RedisFleetState(lease_ttl_s=1.0, heartbeat_s=2.0)
    with pytest.raises(ConfigError):
        RedisFleetState(replica="has|pipe")
    with pytest.raises(ConfigError):
        LoadWeights(in_flight=-1)

    async def empty() -> None:
        s = RedisFleetState("redis://127.0.0.1:1/0", budget_s=0.05)
        with pytest.raises(StateError):
            await s.book("r", [], prefill_tokens=1)
        await s._client.aclose()

    run(empty())
