"""Throughput of the hashing and event-decoding Python API (numpy in, numpy out).

    maturin develop --release -q && python benchmarks/bench_hashing.py

Reports tokens/s for `content_keys` (one long sequence, and many short ones through
`content_keys_batch`), the vLLM parity chain, and batches/s for `decode_batch`.
Best of `--repeat` runs: other load on the machine shows up as noise, not as bias.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from quillcache import _native as nat
from quillcache.events import encode as enc
from quillcache.events import pyref

MTOK = "M tokens/s"


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description="hashing / decoding API throughput")
    ap.add_argument("--tokens", type=int, default=16 << 20, help="tokens per content-key run")
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    tokens32 = rng.integers(0, 152_064, size=args.tokens, dtype=np.uint32)
    tokens64 = tokens32.astype(np.int64)
    ns = nat.Namespace(model="bench", block_size=16)
    rows: list[tuple[str, float, str]] = []

    for bs in (16, 64, 512):
        s = best_seconds(lambda bs=bs: nat.content_keys(tokens32, bs, ns.id), args.repeat)
        rows.append((f"content_keys uint32, block {bs}", args.tokens / s / 1e6, MTOK))
    s = best_seconds(lambda: nat.content_keys(tokens64, 16, ns.id), args.repeat)
    rows.append(("content_keys int64 (range-checked), block 16", args.tokens / s / 1e6, MTOK))

    lengths = rng.integers(256, 4096, size=4096)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = rng.integers(0, 152_064, size=int(offsets[-1]), dtype=np.uint32)
    s = best_seconds(lambda: nat.content_keys_batch(flat, offsets, 16, ns.id), args.repeat)
    rows.append(("content_keys_batch 4096 seqs, block 16", flat.size / s / 1e6, MTOK))

    vllm_tokens = tokens32[: 1 << 20]
    s = best_seconds(lambda: nat.vllm_event_hashes(vllm_tokens, 16), max(1, args.repeat // 2))
    rows.append(("vllm_event_hashes sha256_cbor, block 16", vllm_tokens.size / s / 1e6, MTOK))

    stored = [
        enc.BlockStored(
            block_hashes=[int(x) for x in rng.integers(0, 2**63, size=4)],
            parent_block_hash=int(rng.integers(0, 2**63)),
            token_ids=[int(t) for t in tokens32[i * 64 : (i + 1) * 64]],
            block_size=16,
            extra_keys=[None] * 4,
        )
        for i in range(64)
    ]
    payload = enc.encode_batch(stored, 1.7e9, 0)
    s = best_seconds(lambda: nat.decode_batch(payload), args.repeat)
    rows.append((f"decode_batch native, 64 BlockStored ({len(payload)} B)", 1 / s, "batches/s"))
    s = best_seconds(lambda: pyref.decode_batch(payload), max(1, args.repeat // 2))
    rows.append(("decode_batch pyref (oracle), same batch", 1 / s, "batches/s"))

    width = max(len(r[0]) for r in rows)
    for name, value, unit in rows:
        print(f"{name:<{width}}  {value:>12,.1f} {unit}")


if __name__ == "__main__":
    main()
