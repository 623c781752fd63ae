"""What the shared fleet state adds to a routed request (issue 16): the latency of one
booking round trip to a real `redis-server` on 127.0.0.1.

    python -m benchmarks.state.bench_redis_state [--requests 5000] [--repeats 3] \\
        [--engines 1024] [--outstanding 1000] [--shortlist 4] [--anchors 4] \\
        [--server redis-server] [--json out.json]

Per path (`--paths`: the share scripts on the fast connection, `resp`, or all through
redis-py) and event loop (asyncio, then uvloop, which the gateway runs on), alternated
`--repeats` times, each over `--requests` sequential requests after a warm-up:

- `ping`: a PING on the asyncio fast connection: the floor of any round trip (the
  booking itself goes over its blocking socket on the `resp` path);
- `book`: `RedisFleetState.book` with a `--shortlist`-long shortlist, `--anchors`
  speculative anchors and a session: the one round trip a routed request adds;
- `release`, `prefill_done`: the awaited forms, one round trip each (the gateway
  queues them instead, and its next booking carries them: docs/state.md, "Request
  ends, batched");
- `local`: the in-process `LocalLoadStore.book` + `release` it replaces.

With each booking: the gateway process's CPU time per booking (`process_time`: what a
replica pays in CPU for the round trip, against the gateway's CPU per request).

Before measuring, `--engines` engines get load and `--outstanding` bookings stay live
(from 4 other replicas), so the scripts work on a fleet-sized hash, not an empty one.
The server's own time per script comes from INFO commandstats. Target: book p50
<= 0.3 ms. Run from the repo root.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from quillcache.controlplane.load import LocalLoadStore
from quillcache.state import Booked, Candidate, EngineKey, RedisFleetState
from tests.state.server import RedisServer


def _pcts(ns: list[int]) -> dict[str, float]:
    xs = sorted(ns)
    return {
        "p50_us": xs[len(xs) // 2] / 1e3,
        "p99_us": xs[min(int(len(xs) * 0.99), len(xs) - 1)] / 1e3,
        "mean_us": statistics.fmean(xs) / 1e3,
    }


async def _time(n: int, fn: Callable[[], Awaitable[Any]]) -> list[int]:
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        await fn()
        out.append(time.perf_counter_ns() - t)
    return out


async def _populate(url: str, prefix: str, engines: int, outstanding: int) -> list[RedisFleetState]:
    others = [RedisFleetState(url, prefix=prefix, budget_s=5.0) for _ in range(4)]
    for o in others:
        await o.start()
    everyone = [Candidate(EngineKey(e)) for e in range(engines)]
    for i in range(max(engines, outstanding)):
        o = others[i % len(others)]
        c = everyone[i % engines : i % engines + 1]
        out = await o.book(o.new_request_id(), c, prefill_tokens=512, context_tokens=2048)
        assert isinstance(out, Booked), out
    return others


async def _run(args: argparse.Namespace, url: str, fast_path: bool) -> dict[str, Any]:
    prefix = f"bench-{os.getpid()}-{time.monotonic_ns()}"
    others = await _populate(url, prefix, args.engines, args.outstanding)
    s = RedisFleetState(url, prefix=prefix, budget_s=1.0, fast_path=fast_path)
    await s.start()
    shortlist = [Candidate(EngineKey(e * 7 % args.engines, 0), 64.0) for e in range(args.shortlist)]
    anchors = [(0x1000 + a, 4 << a) for a in range(args.anchors)]
    rids: list[str] = []

    async def book() -> None:
        rid = s.new_request_id()
        out = await s.book(
            rid,
            shortlist,
            prefill_tokens=1024,
            context_tokens=2048,
            anchors=anchors,
            session=f"s{len(rids) % 97}",
        )
        if not isinstance(out, Booked):
            raise RuntimeError(f"booking fell back: {out}")
        rids.append(rid)

    async def prefill() -> None:
        await s.prefill_done(rids[len(done)])
        done.append(1)

    async def release() -> None:
        await s.release(rids.pop())

    done: list[int] = []
    await _time(500, book)  # warm-up: connections, scripts, hash sizes
    for rid in rids:
        await s.release(rid)
    rids.clear()
    client = s._client
    lane = s._lane
    if lane is not None:  # the same connection as the bookings
        ping = await _time(args.requests, lambda: lane.call("PING"))
    else:
        ping = await _time(args.requests, lambda: client.execute_command("PING"))
    await client.execute_command("CONFIG", "RESETSTAT")
    cpu0 = time.process_time()
    booked = await _time(args.requests, book)
    cpu_book_us = (time.process_time() - cpu0) / args.requests * 1e6
    stats = await client.execute_command("INFO", "commandstats")
    prefilled = await _time(args.requests, prefill)
    released = await _time(args.requests, release)
    store = LocalLoadStore(args.engines)
    for r in range(args.engines):
        store.add(r)
    local = []
    for _ in range(args.requests):
        t = time.perf_counter_ns()
        store.book(3, 1024)
        store.release(3, 1024, False)
        local.append(time.perf_counter_ns() - t)
    server_us = float(stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan")))
    assert not s.stats.fallbacks, s.stats
    await s.close()
    for o in others:
        await o.close()
    return {
        "ping": _pcts(ping),
        "book": _pcts(booked),
        "prefill_done": _pcts(prefilled),
        "release": _pcts(released),
        "local_book_release": _pcts(local),
        "server_book_us": server_us,
        "client_cpu_book_us": cpu_book_us,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--engines", type=int, default=1024)
    p.add_argument("--outstanding", type=int, default=1000)
    p.add_argument("--shortlist", type=int, default=4)
    p.add_argument("--anchors", type=int, default=4)
    p.add_argument("--server", default="redis-server")
    p.add_argument(
        "--paths",
        default="resp,redis-py",
        help="resp: the share scripts on the fast connection (the default); redis-py: all "
        "through the redis client (fast_path=False)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import uvloop

    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(args.server, Path(tmp)).start()
        try:
            version = server.binary
            for rep in range(args.repeats):
                for path, loop in itertools.product(args.paths.split(","), ("asyncio", "uvloop")):
                    runner = asyncio.run if loop == "asyncio" else uvloop.run
                    r = runner(_run(args, server.url, path == "resp"))
                    r.update(loop=loop, path=path, repeat=rep)
                    runs.append(r)
                    book, server_us = r["book"], r["server_book_us"]
                    print(
                        f"{path:8} {loop:8} #{rep}: ping p50 {r['ping']['p50_us']:6.1f} us"
                        f" | book p50 {book['p50_us']:6.1f} p99 {book['p99_us']:7.1f} us"
                        f" (server {server_us:.1f} us, client CPU "
                        f"{r['client_cpu_book_us']:.0f} us) | prefill_done p50 "
                        f"{r['prefill_done']['p50_us']:6.1f} | release p50 "
                        f"{r['release']['p50_us']:6.1f} | local "
                        f"{r['local_book_release']['p50_us']:.2f} us",
                        flush=True,
                    )
        finally:
            server.stop()
    load = os.getloadavg()[0]
    for path, loop in itertools.product(args.paths.split(","), ("asyncio", "uvloop")):
        mine = [r for r in runs if r["loop"] == loop and r["path"] == path]
        p50s = [r["book"]["p50_us"] for r in mine]
        p99s = [r["book"]["p99_us"] for r in mine]
        cpu = [r["client_cpu_book_us"] for r in mine]
        print(
            f"{path} {loop}: client CPU per booking {min(cpu):.0f}-{max(cpu):.0f} us; "
            f"book p50 {min(p50s):.1f}-{max(p50s):.1f} us, p99 {min(p99s):.1f}-"
            f"{max(p99s):.1f} us over {len(p50s)} runs (target p50 <= 300 us); "
            f"load {load:.2f}"
        )
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": vars(args) | {"json": str(args.json)}, "server": version, "runs": runs},
                indent=2,
            )
        )


if __name__ == "__main__":
    sys.exit(main())
