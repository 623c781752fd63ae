"""`quillcache bench-route`: what one routing decision costs, per router and fleet size.

    quillcache bench-route --engines 16,64,256,1024 --json out.json

The workload is a fleet's, not a toy's: every request shares the first block (a system
prompt every engine holds, as all 12,031 requests of the Mooncake conversation trace
share block 0), and its conversation prefix is held by 1-3 engines. Per request it
times `ControlPlane.route` plus the load booking (`prefill_done`, `finish`), and
amortises the view's upkeep over the requests: one KV event batch per engine per
second and one load report per engine per second, at `--rate` requests per second.
Reported: decision p50/p99 (route + booking), upkeep per request, and their sum.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from quillcache.events.encode import BlockStored, encode_batch
from quillcache.identity import content_keys, namespace

BLOCK_SIZE = 16
PREFIX_BLOCKS = 24  # a conversation's cached prefix
NEW_BLOCKS = 8  # what each request adds beyond it


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines",
        default="16,64,256,1024",
        help="comma-separated fleet sizes (engines, one DP rank each)",
    )
    parser.add_argument(
        "--routers",
        default="all",
        help="comma-separated routers (registered names or 'pkg.module:Class'), or 'all' "
        "(the built-in ones)",
    )
    parser.add_argument("--requests", type=int, default=2_500, help="timed requests per cell")
    parser.add_argument(
        "--rate",
        type=float,
        default=1_000.0,
        help="requests per second the upkeep is amortised over (events and load reports "
        "arrive once per engine per second)",
    )
    parser.add_argument(
        "--conversations-per-engine",
        type=int,
        default=4,
        help="conversation prefixes per engine in the index",
    )
    parser.add_argument(
        "--sessions",
        action="store_true",
        help="each request carries its conversation as a session id (the session path of "
        "session-aware routers: homes, live sessions)",
    )
    parser.add_argument("--index", default="native", help="index backend")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON ('-' for stdout)")


@dataclass(frozen=True, slots=True)
class Fleet:
    """A fleet's index content and request stream, identical for every router."""

    engines: int
    stored: dict[int, list[bytes]]  # engine -> event batches that build its cache
    requests: list[tuple[np.ndarray[Any, np.dtype[np.uint64]], int, int]]  # keys, tokens, conv
    refresh: list[tuple[int, bytes]]  # the per-second event batches (engine, payload)


def _tokens(conversation: int, blocks: int, salt: int = 0) -> list[int]:
    # block 0: the system prompt every conversation shares
    head = list(range(BLOCK_SIZE))
    body = [
        100_000 + (conversation * 7_919 + salt * 104_729 + t) % 1_000_000
        for t in range((blocks - 1) * BLOCK_SIZE)
    ]
    return head + body


def build_fleet(engines: int, conversations_per_engine: int, requests: int, seed: int) -> Fleet:
    rng = random.Random(seed)
    ns = namespace("", "", "", "", BLOCK_SIZE)
    conversations = engines * conversations_per_engine
    holders = {
        c: rng.sample(range(engines), rng.randint(1, min(3, engines))) for c in range(conversations)
    }
    stored: dict[int, list[bytes]] = {e: [] for e in range(engines)}
    next_hash = 1
    for c, owners in holders.items():
        tokens = _tokens(c, PREFIX_BLOCKS)
        for e in owners:
            ev = BlockStored(
                block_hashes=list(range(next_hash, next_hash + PREFIX_BLOCKS)),
                parent_block_hash=None,
                token_ids=tokens,
                block_size=BLOCK_SIZE,
            )
            next_hash += PREFIX_BLOCKS
            stored[e].append(encode_batch([ev], 1.0, 0))
    reqs = []
    for i in range(requests):
        c = rng.randrange(conversations)
        tokens = _tokens(c, PREFIX_BLOCKS) + _tokens(c, NEW_BLOCKS + 1, salt=i + 1)[BLOCK_SIZE:]
        keys = np.asarray(content_keys(tokens, BLOCK_SIZE, ns), dtype=np.uint64)
        reqs.append((keys, len(tokens), c))
    # An engine that no conversation landed on (at thousands of engines, a few) still
    # holds the system prompt, as the workload says every engine does.
    for e in range(engines):
        if not stored[e]:
            ev = BlockStored([next_hash], None, _tokens(0, 1), BLOCK_SIZE)
            next_hash += 1
            stored[e].append(encode_batch([ev], 1.0, 0))
    refresh = []
    for e in range(engines):  # one small batch per engine: a block stored and removed
        h = 10**12 + e
        ev = BlockStored([h], None, _tokens(conversations + e, 1, salt=e + 7), BLOCK_SIZE)
        refresh.append((e, encode_batch([ev], 2.0, 0)))
    return Fleet(engines, stored, reqs, refresh)


def bench_cell(
    fleet: Fleet, router: str, index: str, rate: float, sessions: bool = False
) -> dict[str, Any]:
    from quillcache.controlplane import ControlPlane
    from quillcache.routing import Request

    cp = ControlPlane(index=index, router=router, block_size=BLOCK_SIZE, track_load=True)
    for e in range(fleet.engines):
        cp.add_worker(e)
        cp.ingest(e, fleet.stored[e])
    rng = random.Random(1)
    loads = [
        {
            "queued_prefill_tokens": float(rng.randrange(0, 4_000)),
            "running_decodes": float(rng.randrange(0, 32)),
            "kv_usage": rng.random(),
            "mean_context_tokens": float(rng.randrange(500, 4_000)),
        }
        for _ in range(fleet.engines)
    ]
    for e, load in enumerate(loads):
        cp.update_load(e, **load)
    # upkeep per request: engines / rate event batches and load reports
    per_request = fleet.engines / rate
    owed = 0.0
    cursor = 0
    decide_ns = np.empty(len(fleet.requests), dtype=np.int64)
    upkeep_ns = 0
    now = 0.0
    for i, (keys, tokens, conversation) in enumerate(fleet.requests):
        owed += per_request
        t0 = time.perf_counter_ns()
        while owed >= 1.0:
            e, payload = fleet.refresh[cursor % fleet.engines]
            cp.ingest(e, [payload])
            cp.update_load(e, **loads[e])
            cursor += 1
            owed -= 1.0
        t1 = time.perf_counter_ns()
        upkeep_ns += t1 - t0
        now += 1.0 / rate
        session = f"conversation-{conversation}" if sessions else None
        request = Request(
            i, keys, tokens, expected_output_tokens=64, arrival_s=now, session_id=session
        )
        decision = cp.route(request, now_s=now)
        cp.prefill_done(i)
        cp.finish(i)
        decide_ns[i] = time.perf_counter_ns() - t1
        if decision.worker is None:
            raise RuntimeError(f"router {router} rejected a request: {decision.reason}")
    cp.close()
    p50, p99 = np.percentile(decide_ns, [50, 99]) / 1e3
    upkeep = upkeep_ns / len(fleet.requests) / 1e3
    return {
        "router": router,
        "engines": fleet.engines,
        "decide_p50_us": float(p50),
        "decide_p99_us": float(p99),
        "upkeep_us": float(upkeep),
        "p50_us": float(p50) + upkeep,
        "p99_us": float(p99) + upkeep,
    }


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from quillcache.console import table_console
    from quillcache.errors import ConfigError
    from quillcache.index import backend_status
    from quillcache.routing import BUILTIN_ORDER, available_routers
    from quillcache.routing.registry import import_router

    try:
        sizes = [int(s) for s in args.engines.split(",") if s]
    except ValueError:
        raise ConfigError(
            f"--engines wants comma-separated integers, got {args.engines!r}"
        ) from None
    if not sizes or min(sizes) < 1:
        raise ConfigError("--engines wants at least one fleet size >= 1")
    if args.requests < 1:
        raise ConfigError(f"--requests must be >= 1, got {args.requests}")
    if args.rate <= 0:
        raise ConfigError(f"--rate must be positive, got {args.rate}")
    routers = list(BUILTIN_ORDER) if args.routers == "all" else args.routers.split(",")
    for r in routers:
        if ":" in r:  # a user's router class, as the gateway and simulate take it
            import_router(r)
    unknown = [r for r in routers if r not in set(available_routers())]
    if unknown:
        known = ", ".join(available_routers())
        raise ConfigError(f"unknown routers {', '.join(unknown)}; known: {known}")
    status = backend_status()
    if args.index not in status:
        raise ConfigError(f"unknown index backend {args.index!r}; known: {', '.join(status)}")
    if status[args.index] is not None:
        raise ConfigError(f"index backend {args.index!r} is unavailable: {status[args.index]}")
    to_stdout = args.json == "-"
    progress = Console(stderr=True)
    results = []
    for n in sizes:
        fleet = build_fleet(n, args.conversations_per_engine, args.requests, args.seed)
        for r in routers:
            progress.print(f"bench-route: {r} at {n} engines", highlight=False)
            results.append(bench_cell(fleet, r, args.index, args.rate, args.sessions))
    sessions = ", requests in sessions" if args.sessions else ""
    table = Table(
        title=f"routing decision cost (µs; {args.index} index, {args.requests} requests{sessions})"
    )
    table.add_column("router")
    for n in sizes:
        table.add_column(f"{n} p50", justify="right")
        table.add_column(f"{n} p99", justify="right")
    for r in routers:
        row = [r]
        for n in sizes:
            cell = next(x for x in results if x["router"] == r and x["engines"] == n)
            row += [f"{cell['p50_us']:.0f}", f"{cell['p99_us']:.0f}"]
        table.add_row(*row)
    table_console(json_on_stdout=to_stdout).print(table)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        text = json.dumps({"results": results, "args": settings}, indent=2)
        if to_stdout:
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0
