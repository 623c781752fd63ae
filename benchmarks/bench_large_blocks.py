"""Apply cost of the simulator's event shape: one BlockStored of 24 blocks x 512 tokens.

    python benchmarks/bench_large_blocks.py          # release build first

Each round applies `--batches` such batches (uint16 token ids, as `quillcache.sim.wire`
packs them) to a fresh native index over 8 workers and times this thread's CPU; the
minimum and median over the rounds are printed (docs/index.md, "Numbers").
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from quillcache.index import create_backend
from quillcache.sim import wire

BLOCK_SIZE, BLOCKS_PER_EVENT, WORKERS = 512, 24, 8


def build_payloads(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    payloads = []
    for _ in range(n):
        tokens = rng.integers(256, 50_000, size=BLOCKS_PER_EVENT * BLOCK_SIZE, dtype=np.uint32)
        hashes = [int(h) for h in rng.integers(0, 2**63, size=BLOCKS_PER_EVENT, dtype=np.int64)]
        event = wire.block_stored(hashes, None, tokens, BLOCK_SIZE)
        payloads.append(wire.batch(1.0, [event]))
    return payloads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    payloads = build_payloads(args.batches)
    per_batch = []
    for _ in range(args.rounds):
        index = create_backend("native")
        t0 = time.thread_time()
        for i, payload in enumerate(payloads):
            index.apply(i % WORKERS, [payload])
        per_batch.append((time.thread_time() - t0) / len(payloads))
        index.close()
    print(
        f"{BLOCKS_PER_EVENT}x{BLOCK_SIZE}-token BlockStored batch: "
        f"min {min(per_batch) * 1e6:.1f} us, median {statistics.median(per_batch) * 1e6:.1f} us "
        f"CPU per batch ({args.batches} batches x {args.rounds} rounds)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
