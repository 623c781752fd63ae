"""A replica as a process of its own, for the lease tests: it books `--book` requests
on engine `--engine`, prints READY, and keeps its lease alive until it is killed.

    python -m tests.state.replica_proc --url redis://127.0.0.1:PORT/0 --prefix P
"""

from __future__ import annotations

import argparse
import asyncio

from quillcache.state import Booked, Candidate, EngineKey, RedisFleetState


async def main(args: argparse.Namespace) -> None:
    s = RedisFleetState(args.url, prefix=args.prefix, lease_ttl_s=args.ttl, budget_s=1.0)
    await s.start()
    for _ in range(args.book):
        out = await s.book(
            s.new_request_id(), [Candidate(EngineKey(args.engine))], prefill_tokens=100
        )
        assert isinstance(out, Booked), out
    print(f"READY {s.replica}", flush=True)
    while True:
        await asyncio.sleep(3600)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--ttl", type=float, default=1.0)
    p.add_argument("--book", type=int, default=5)
    p.add_argument("--engine", type=int, default=3)
    asyncio.run(main(p.parse_args()))
