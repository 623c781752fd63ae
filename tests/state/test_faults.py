"""Faults with real processes: a replica SIGKILLed while it holds bookings, Redis
stopped and restarted empty, Redis too slow."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache.state import Booked, EngineKey, LocalFallback, RedisFleetState, Shared
from tests.state.helpers import fleet, in_flight, loads_of, run, shortlist
from tests.state.server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
TTL = 1.0
SLACK = 0.5  # the observer's poll interval, scheduling on a loaded 2-core machine


def _replica(url: str, prefix: str, engine: int, book: int) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.state.replica_proc", "--url", url, "--prefix", prefix,
         "--ttl", str(TTL), "--book", str(book), "--engine", str(engine)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"replica did not start: {line!r}"
    return proc, line.split()[1]


def test_a_killed_replicas_load_lapses_with_its_lease(redis_server: RedisServer) -> None:
    prefix = fleet()
    victim, _ = _replica(redis_server.url, prefix, engine=3, book=5)
    survivor, _ = _replica(redis_server.url, prefix, engine=1, book=2)
    try:

        async def main() -> float:
            obs = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
            await obs.start(background=False)
            try:
                assert in_flight(await loads_of(obs)) == {1: 2, 3: 5}
                # alive, it renews its lease: the load stays past several TTLs
                await asyncio.sleep(2.5 * TTL)
                assert in_flight(await loads_of(obs)) == {1: 2, 3: 5}
                os.kill(victim.pid, signal.SIGKILL)
                killed = time.monotonic()
                while in_flight(await loads_of(obs)).get(3):
                    assert time.monotonic() - killed < TTL + SLACK + 5, "never lapsed"
                    await asyncio.sleep(0.02)
                gone = time.monotonic() - killed
                # the survivor's share is untouched
                assert in_flight(await loads_of(obs)) == {1: 2}
                return gone
            finally:
                await obs.close()

        gone = run(main())
        assert gone <= TTL + SLACK, f"the killed replica's load went after {gone:.2f} s"
    finally:
        for p in (victim, survivor):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
            p.wait(10)


@pytest.mark.parametrize(
    ("fast_path", "loop"),
    [(True, "asyncio"), (True, "uvloop"), (False, "asyncio")],
    ids=["resp", "resp-uvloop", "redis-py"],
)
def test_redis_down_fails_open_then_resyncs_after_an_empty_restart(
    redis_server: RedisServer, fast_path: bool, loop: str
) -> None:
    async def main() -> None:
        prefix = fleet()
        s = RedisFleetState(
            redis_server.url,
            prefix=prefix,
            budget_s=0.5,  # a loaded CI host: the first scripts load slowly
            lease_ttl_s=1.0,
            reconnect_s=0.05,
            fast_path=fast_path,
        )
        await s.start()
        try:
            rids = [s.new_request_id() for _ in range(4)]
            for rid in rids[:3]:
                assert isinstance(await s.book(rid, shortlist(2, 2), prefill_tokens=10), Booked)
            redis_server.stop()
            t0 = time.monotonic()
            out = await s.book(rids[3], shortlist(2, 2), prefill_tokens=10)
            assert isinstance(out, LocalFallback) and out.engine == EngineKey(1)
            assert time.monotonic() - t0 < 0.2
            assert isinstance(await s.release(rids[0]), LocalFallback)
            assert isinstance(await s.prefill_done(rids[1]), LocalFallback)
            assert isinstance(await s.loads(), LocalFallback)
            assert not s.healthy and s.stats.fallbacks["book"] >= 1
            assert s.stats.fell_back_bookings == 1
            # while it is down, calls cost no wait at all
            t0 = time.monotonic()
            for _ in range(100):
                await s.book(s.new_request_id(), shortlist(9), prefill_tokens=1)
            assert time.monotonic() - t0 < 0.1
            for rid in list(s.booked()):
                if rid not in rids:
                    await s.release(rid)
            redis_server.start(same_port=True)  # empty: no persistence
            deadline = time.monotonic() + 10
            while not s.healthy:
                assert time.monotonic() < deadline, "never reconnected"
                await asyncio.sleep(0.02)
            assert s.stats.reconnects == 1
            obs = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
            await obs.start(background=False)
            # the share is this replica's book: 0 released, 1 prefilled, 2 and 3 booked
            got = {k: (v.in_flight, v.queued_prefill_tokens, v.running_decodes)
                   for k, v in (await loads_of(obs)).items()}  # fmt: skip
            book = s.booked()
            assert sorted(book) == sorted(rids[1:]) and book[rids[1]][3]
            assert got == {
                k: (
                    sum(1 for e in book.values() if e[0] == k),
                    sum(e[1] for e in book.values() if e[0] == k and not e[3]),
                    sum(1 for e in book.values() if e[0] == k and e[3]),
                )
                for k in {e[0] for e in book.values()}
            }
            # and booking is shared again
            assert isinstance(
                await s.book(s.new_request_id(), shortlist(9), prefill_tokens=1), Booked
            )
            await obs.close()
        finally:
            await s.close()

    run(main(), loop=loop)


def test_a_restart_between_calls_is_found_by_the_lease(redis_server: RedisServer) -> None:
    """Redis restarts empty while the replica's connection pool reconnects silently: the
    next script finds no lease, the call falls back and the share is put back."""

    async def main() -> None:
        prefix = fleet()
        s = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0, lease_ttl_s=1.0)
        await s.start(background=False)
        try:
            a = s.new_request_id()
            assert isinstance(await s.book(a, shortlist(5), prefill_tokens=7), Booked)
            redis_server.stop()
            redis_server.start(same_port=True)
            # the pooled connection is dead: this call fails over; the next ones reconnect
            b = s.new_request_id()
            first = await s.book(b, shortlist(5), prefill_tokens=7)
            assert isinstance(first, LocalFallback)
            while not s.healthy:
                await s.beat()
            c = s.new_request_id()
            assert isinstance(await s.book(c, shortlist(5), prefill_tokens=7), Booked)
            obs = RedisFleetState(redis_server.url, prefix=prefix, budget_s=1.0)
            await obs.start(background=False)
            assert in_flight(await loads_of(obs)) == {0: 3}
            # a FLUSHALL (or an expiry of this lease while it paused) while connected
            await obs._client.flushall()
            d = s.new_request_id()
            lost = await s.book(d, shortlist(5), prefill_tokens=7)
            assert isinstance(lost, LocalFallback) and "lease" in lost.reason
            assert s.stats.lost_leases == 1
            await s.beat()  # the resync
            assert in_flight(await loads_of(obs)) == {0: 4}
            assert await s.release(d) == Shared("ok")
            assert in_flight(await loads_of(obs)) == {0: 3}
            await obs.close()
        finally:
            await s.close()

    run(main())


@pytest.mark.parametrize("fast_path", [True, False], ids=["resp", "redis-py"])
def test_redis_slower_than_the_budget(redis_server: RedisServer, fast_path: bool) -> None:
    async def main() -> None:
        prefix = fleet()
        s = RedisFleetState(
            redis_server.url, prefix=prefix, budget_s=0.25, slow_limit=100, fast_path=fast_path
        )  # a budget a loaded CI host keeps for the first booking
        await s.start(background=False)
        try:
            a = s.new_request_id()
            assert isinstance(await s.book(a, shortlist(1, 1), prefill_tokens=3), Booked)
            redis_server.pause()  # SIGSTOP: the socket is open, nothing answers
            try:
                t0 = time.monotonic()
                b = s.new_request_id()
                out = await s.book(b, shortlist(1, 1), prefill_tokens=3)
                waited = time.monotonic() - t0
            finally:
                redis_server.resume()
            assert isinstance(out, LocalFallback) and "slower" in out.reason
            assert out.engine == EngineKey(1)
            assert 0.24 <= waited < 1.0
            assert s.stats.timeouts == 1
            assert s.healthy  # one slow call does not take Redis out of use
            await asyncio.sleep(0.1)  # the timed-out call reaches Redis after all
            await s.beat()  # the share may differ from the book: resync
            assert s.stats.resyncs == 2
            assert in_flight(await loads_of(s)) == {0: 1, 1: 1}
        finally:
            await s.close()

    run(main())


def test_resync_while_bookings_are_in_flight(redis_server: RedisServer) -> None:
    """A resync replaces the replica's share with its book; calls in flight meanwhile
    must neither be lost nor counted twice (the resync waits for them and holds new
    ones back)."""

    async def main() -> None:
        prefix = fleet()
        s = RedisFleetState(redis_server.url, prefix=prefix, budget_s=2.0)
        await s.start(background=False)
        try:

            async def churn(k: int) -> None:
                for j in range(40):
                    rid = s.new_request_id()
                    await s.book(rid, shortlist(3, 3, 3), prefill_tokens=k + j)
                    if j % 2:
                        await s.prefill_done(rid)
                    if j % 3:
                        await s.release(rid)

            async def resyncs() -> None:
                for _ in range(100):
                    assert await s.resync()
                    await asyncio.sleep(0)

            await asyncio.gather(*(churn(k) for k in range(16)), resyncs())
            assert not s.stats.fallbacks
            book = s.booked()
            want: dict[EngineKey, list[int]] = {}
            for e, q, c, p in book.values():
                row = want.setdefault(e, [0, 0, 0, 0])
                row[0] += 1
                row[1] += 0 if p else q
                row[2] += 1 if p else 0
                row[3] += c if p else 0
            got = {k: [v.in_flight, v.queued_prefill_tokens, v.running_decodes, v.context_tokens]
                   for k, v in (await loads_of(s)).items()}  # fmt: skip
            assert got == want
        finally:
            await s.close()

    for _round in range(3):  # the race it guards against needs a few rounds to show
        run(main())
