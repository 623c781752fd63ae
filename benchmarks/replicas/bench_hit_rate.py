"""Several gateways against one: the engines' own prefix-cache hit rate (issue 16 §4).

    python -m benchmarks.replicas.bench_hit_rate --requests 800 --repeats 2

Three fleets of 8 engine simulators, fresh for each measurement, serve the same
workload: one gateway; 4 replicas sharing their state through a `redis-server`
(`--state redis://`); 4 replicas with private state (each its own load and
speculative placements; every replica still subscribes to every engine's events).
The client spreads requests over the replicas round-robin, as a load balancer does,
with `--concurrency` in flight. The workload: `--prefixes` shared prefixes of 16 blocks,
each request one of them (uniformly) plus 2 blocks of its own, so that a prefix's first
requests arrive together at different replicas. The engines' KV caches hold a third of
what every prefix on every engine would need, so a prefix computed on several engines
evicts others. Reported: the engines' prefix-cache hit rate (their own
`vllm:prefix_cache_hits` / `queries` counters, in tokens), per fleet, side by side.

Run from the repo root; needs `redis-server` (make deps).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from quillcache.up import Proc, engine_args, fleet_stack, gateway_args, launch, stack

BLOCK = 16  # the engine simulator's block size (one token per byte, builtin tokenizer)
PREFIX_BLOCKS = 16
OWN_BLOCKS = 2
ENGINES = 8
REPLICAS = 4
Fleet = tuple[list[Proc], list[Proc]]  # the engines, the gateways


def prompt(prefix: int, request: int) -> str:
    head = f"[prefix {prefix:03d}] " + "a long shared system prompt " * 20
    head = head[: PREFIX_BLOCKS * BLOCK]
    tail = (f"<request {request:06d}>" * 4)[: OWN_BLOCKS * BLOCK]
    return head + tail


def counters(engines: list[Proc]) -> tuple[float, float]:
    """(hit tokens, queried tokens) summed over the engines."""
    hits = queries = 0.0
    for e in engines:
        page = httpx.get(e.url + "/metrics", timeout=10.0).text
        for line in page.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def drive(gateways: list[Proc], requests: int, concurrency: int, prefixes: int, seed: int) -> int:
    """Send the workload round-robin over `gateways`; the number answered."""
    clients = [
        openai.OpenAI(base_url=g.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        for g in gateways
    ]
    rng = random.Random(seed)
    chosen = [rng.randrange(prefixes) for _ in range(requests)]

    def one(i: int) -> bool:
        out = clients[i % len(clients)].completions.create(
            model="sim-model", prompt=prompt(chosen[i], i), max_tokens=4
        )
        return bool(out.choices)

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(one, range(requests)))


def wait_ready(gateways: list[Proc], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for g in gateways:
        while httpx.get(g.url + "/ready", timeout=5.0).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{g.name} not ready after {timeout_s:.0f} s")
            time.sleep(0.1)


@contextmanager
def private_fleet(workdir: Path, engine_extra: list[str]) -> Iterator[Fleet]:
    procs: list[Proc] = []
    try:
        engines = [
            launch(f"engine{i}", engine_args(extra=engine_extra), workdir) for i in range(ENGINES)
        ]
        procs += engines
        secret = ["--secret-file", str(workdir / "gateway-secret.json")]
        gateways = []
        for i in range(REPLICAS):
            g = launch(f"gateway{i}", gateway_args([e.url for e in engines], extra=secret), workdir)
            procs.append(g)
            gateways.append(g)
        yield engines, gateways
    finally:
        for p in procs:
            p.kill()


@contextmanager
def fleet(kind: str, workdir: Path, engine_extra: list[str]) -> Iterator[Fleet]:
    if kind == "one gateway":
        with stack(ENGINES, workdir=workdir, engine_extra=engine_extra) as (engines, gateway):
            yield engines, [gateway]
    elif kind == "4 replicas, shared state":
        with fleet_stack(ENGINES, REPLICAS, workdir=workdir, engine_extra=engine_extra) as (
            _redis,
            engines,
            gateways,
        ):
            yield engines, gateways
    else:
        with private_fleet(workdir, engine_extra) as out:
            yield out


KINDS = ("one gateway", "4 replicas, shared state", "4 replicas, private state")


def measure(kind: str, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    capacity = max(PREFIX_BLOCKS + OWN_BLOCKS, args.prefixes * (PREFIX_BLOCKS + OWN_BLOCKS) // 3)
    engine_extra = [
        "--num-gpu-blocks", str(capacity), "--block-size", str(BLOCK),
        "--time-scale", str(args.time_scale),
    ]  # fmt: skip
    with (
        tempfile.TemporaryDirectory(prefix="qc-hit-rate-") as tmp,
        fleet(kind, Path(tmp), engine_extra) as (engines, gateways),
    ):
        wait_ready(gateways)
        before = counters(engines)
        t0 = time.perf_counter()
        ok = drive(gateways, args.requests, args.concurrency, args.prefixes, seed)
        wall = time.perf_counter() - t0
        after = counters(engines)
    hits, queries = after[0] - before[0], after[1] - before[1]
    return {
        "fleet": kind,
        "seed": seed,
        "answered": ok,
        "hit_rate": hits / queries if queries else 0.0,
        "wall_s": wall,
        "capacity_blocks_per_engine": capacity,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2, help="alternations of the three fleets")
    p.add_argument("--time-scale", type=float, default=0.25, help="engine latency multiplier")
    p.add_argument("--json", help="write every run here ('-': stdout)")
    args = p.parse_args(argv)
    runs = []
    for r in range(args.repeats):
        for kind in KINDS:
            res = measure(kind, args, seed=r)
            runs.append(res)
            print(
                f"{kind:28s} seed {r}: hit rate {100 * res['hit_rate']:.1f} % "
                f"({res['answered']} answered, {res['wall_s']:.1f} s)",
                file=sys.stderr,
            )

    def mean_rate(kind: str) -> float:
        return statistics.mean(x["hit_rate"] for x in runs if x["fleet"] == kind)

    one = mean_rate(KINDS[0])
    for kind in KINDS[1:]:
        gap = 100 * (mean_rate(kind) - one)
        print(f"{kind}: {gap:+.1f} points against one gateway (target: within 2)", file=sys.stderr)
    if args.json:
        text = json.dumps({"runs": runs, "args": vars(args)}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
