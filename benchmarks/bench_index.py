"""Index benchmarks through the Python API: ingest, match latency, memory.

The workload is the one of `rust/core/benches/index.rs` (docs/index.md, "Numbers"):
64 workers, block size 16; 256 system prompts of 8 blocks, each served by a home set
of 4 workers; sessions of 8 turns x 8 blocks on one worker of their prompt's home
set, published as vLLM does (a turn stores its new blocks chained to the previous
turn's last hash; the first session of a prompt on a worker also stores the prompt).
Sessions are added until the index holds `--blocks` blocks. A match request is the
first 64 blocks of a random session. Payloads are raw msgpack built by
`quillcache.events.encode` (vLLM's wire format).

    python benchmarks/bench_index.py                      # native + memory, table
    python benchmarks/bench_index.py --backends native --json out.json

To compare two builds side by side, build the workload once (`--workload PATH`
writes it on the first run and reads it afterwards) and alternate the runs:

    for i in 1 2 3; do for d in before after; do
      PYTHONPATH=$d python benchmarks/bench_index.py --backends native --workload /tmp/w.pkl
    done; done

Build the extension in release mode first (`maturin develop --release`).
"""

from __future__ import annotations

import argparse
import gc
import json
import pickle
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from quillcache.events import encode as enc
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.index import create_backend

WORKERS, BS, PROMPTS, SYS_BLOCKS, TURNS, TURN_BLOCKS, HOME = 64, 16, 256, 8, 8, 8, 4
REQUEST_BLOCKS = 64


@dataclass
class Workload:
    calls: list[tuple[int, list[bytes]]]  # (worker, payloads) per apply call
    blocks_stored: int
    requests: list[np.ndarray]


def build_workload(target_blocks: int, seed: int = 42, n_requests: int = 4096) -> Workload:
    rng = random.Random(seed)

    def tokens(n_blocks: int) -> list[int]:
        return [rng.randrange(50_000) for _ in range(n_blocks * BS)]

    def hashes(n: int) -> list[int]:
        return [rng.getrandbits(64) for _ in range(n)]

    sys_prompts = [(tokens(SYS_BLOCKS), hashes(SYS_BLOCKS)) for _ in range(PROMPTS)]
    has_prompt: set[tuple[int, int]] = set()
    calls: list[tuple[int, list[bytes]]] = []
    sessions: list[list[int]] = []  # tokens of the first REQUEST_BLOCKS blocks
    distinct, stored = PROMPTS * SYS_BLOCKS, 0
    while distinct < target_blocks:
        p = rng.randrange(PROMPTS)
        worker = (p * HOME + rng.randrange(HOME)) % WORKERS
        sys_toks, sys_hashes = sys_prompts[p]
        last_hash = sys_hashes[-1]
        all_toks = list(sys_toks)
        payloads = []
        for turn in range(TURNS):
            toks, hs = tokens(TURN_BLOCKS), hashes(TURN_BLOCKS)
            if turn == 0 and (worker, p) not in has_prompt:
                has_prompt.add((worker, p))
                ev = enc.BlockStored(sys_hashes + hs, None, sys_toks + toks, BS)
            else:
                ev = enc.BlockStored(hs, last_hash, toks, BS)
            payloads.append(enc.encode_batch([ev], ts=1.0, dp_rank=0))
            stored += len(ev.block_hashes)
            last_hash = hs[-1]
            all_toks += toks
        calls.append((worker, payloads))
        sessions.append(all_toks[: REQUEST_BLOCKS * BS])
        distinct += TURNS * TURN_BLOCKS
    root = namespace_id(block_size=BS)
    requests = [
        np.array(content_keys(sessions[rng.randrange(len(sessions))], BS, root), dtype=np.uint64)
        for _ in range(n_requests)
    ]
    return Workload(calls, stored, requests)


def load_or_build(path: str | None, size: int) -> Workload:
    """The workload of `size` blocks, from `path` if it holds one (a trusted local file)."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                saved_size, w = pickle.load(f)
            if saved_size == size and isinstance(w, Workload):
                return w
        except FileNotFoundError:
            pass
    w = build_workload(size)
    if path is not None:
        with open(path, "wb") as f:
            pickle.dump((size, w), f)
    return w


@dataclass
class Result:
    backend: str
    blocks: int
    resident_pairs: int
    ingest_blocks_per_s: float
    ingest_blocks_per_cpu_s: float
    match_p50_ns: int
    match_p99_ns: int
    matches_per_request: float
    memory_bytes: int
    bytes_per_pair: float


def ingest(name: str, w: Workload, reserve: int = 0, many: int = 0) -> tuple[Any, float, float]:
    """Apply the whole workload to a fresh index: (index, wall seconds, CPU seconds).

    CPU time (this thread's) is reported too: on a shared, loaded machine the wall
    time of a long run overstates its cost. `reserve` > 0 passes that capacity hint
    first (timed with the ingest). `many` > 0: `apply_many` with that many sessions
    per call (what a connector draining its queue passes) instead of one `apply` per
    session.
    """
    index = create_backend(name)
    gc.collect()
    t0, c0 = time.perf_counter(), time.thread_time()
    if reserve:
        index.reserve(reserve)
    if many:
        for at in range(0, len(w.calls), many):
            index.apply_many(w.calls[at : at + many])
    else:
        for worker, payloads in w.calls:
            index.apply(worker, payloads)
    return index, time.perf_counter() - t0, time.thread_time() - c0


def bench(
    name: str,
    w: Workload,
    rounds: int,
    samples: int,
    reserve: int = 0,
    after_snapshot: bool = False,
    many: int = 0,
) -> Result:
    times, cpu_times = [], []
    index = None
    for _ in range(rounds):
        if index is not None:
            index.close()
        index, seconds, cpu_seconds = ingest(name, w, reserve, many)
        times.append(seconds)
        cpu_times.append(cpu_seconds)
    assert index is not None
    if after_snapshot:  # match on the index a restart would restore
        restored = type(index).from_snapshot(index.snapshot())
        index.close()
        index = restored
    lat = np.empty(samples, dtype=np.int64)
    match, reqs, now = index.match, w.requests, time.perf_counter_ns
    gc.disable()
    for i in range(samples):
        req = reqs[(i * 7919) % len(reqs)]
        t0 = now()
        match(req)
        lat[i] = now() - t0
    gc.enable()
    hits = sum(len(index.match(r)) for r in reqs[:512]) / min(512, len(reqs))
    st = index.stats()
    index.close()
    return Result(
        backend=f"{name} (apply_many x{many})" if many else name,
        blocks=st.blocks,
        resident_pairs=st.resident_pairs,
        ingest_blocks_per_s=w.blocks_stored / statistics.median(times),
        ingest_blocks_per_cpu_s=w.blocks_stored / statistics.median(cpu_times),
        match_p50_ns=int(np.percentile(lat, 50)),
        match_p99_ns=int(np.percentile(lat, 99)),
        matches_per_request=hits,
        memory_bytes=st.memory_bytes,
        bytes_per_pair=st.memory_bytes / max(st.resident_pairs, 1),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", nargs="+", default=["native", "memory"])
    ap.add_argument("--blocks", type=int, default=1_000_000, help="index size (native)")
    ap.add_argument(
        "--memory-blocks",
        type=int,
        default=200_000,
        help="index size for the slow 'memory' backend",
    )
    ap.add_argument("--rounds", type=int, default=3, help="ingest repetitions (median)")
    ap.add_argument("--samples", type=int, default=100_000, help="single-match timings")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-' = stdout)")
    ap.add_argument(
        "--reserve",
        action="store_true",
        help="give the native index its final size as a capacity hint before ingest",
    )
    ap.add_argument(
        "--after-snapshot",
        action="store_true",
        help="time matches on the native index restored from a snapshot of the built one",
    )
    ap.add_argument(
        "--apply-many",
        type=int,
        default=0,
        metavar="N",
        help="native: ingest with apply_many, N sessions (of 8 payloads) per call",
    )
    ap.add_argument(
        "--workload",
        metavar="PATH",
        help="pickle of the workload: read if it exists, else built and written (native only)",
    )
    args = ap.parse_args(argv)
    results = []
    workloads: dict[int, Workload] = {}
    for name in args.backends:
        size = args.memory_blocks if name == "memory" else args.blocks
        if size not in workloads:
            workloads[size] = load_or_build(args.workload if name != "memory" else None, size)
        rounds = 1 if name == "memory" else args.rounds
        samples = min(args.samples, 20_000) if name == "memory" else args.samples
        reserve = size if args.reserve and name == "native" else 0
        after_snapshot = args.after_snapshot and name == "native"
        many = args.apply_many if name == "native" else 0
        w = workloads[size]
        results.append(bench(name, w, rounds, samples, reserve, after_snapshot, many))
    from rich.table import Table

    from quillcache.console import table_console

    table = Table(title="index benchmarks (python API, release build)")
    for col in (
        "backend",
        "blocks",
        "pairs",
        "ingest M blocks/s",
        "match p50 µs",
        "match p99 µs",
        "hits/req",
        "bytes/pair",
    ):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(
            r.backend,
            f"{r.blocks:,}",
            f"{r.resident_pairs:,}",
            f"{r.ingest_blocks_per_s / 1e6:.2f}",
            f"{r.match_p50_ns / 1e3:.2f}",
            f"{r.match_p99_ns / 1e3:.2f}",
            f"{r.matches_per_request:.1f}",
            f"{r.bytes_per_pair:.1f}",
        )
    table_console(json_on_stdout=args.json == "-").print(table)
    if args.json:
        text = json.dumps([asdict(r) for r in results], indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
