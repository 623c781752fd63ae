"""Workloads for `quillcache bench-index`: event batches in vLLM's wire format plus
the match and subtree-scan queries to time.

* ``seed``: the original QuillCache study's workload, reproduced so both tables can
  be read side by side: 2,000 requests x (16 shared + 4 unique) blocks on one worker,
  every block stored (40,000 puts, 8,016 resident), 20,000 queries.
* ``synthetic``: prefix families with Zipf popularity over several workers, each
  worker a vLLM-like LRU cache that stores only the blocks it misses and evicts
  (BlockRemoved) beyond its capacity.
* ``mooncake``: the Mooncake conversation trace (`hash_ids` chained per request),
  replayed over the same per-worker LRU caches; one trace block = one index block.

Engine hashes are the blocks' content keys (any unique opaque id would do).
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quillcache.events import encode as enc
from quillcache.hashing import content_keys, namespace_id

BLOCK_SIZE = 16
TOKEN_MASK = (1 << 31) - 1
#: `../shared/traces/` next to the repository, where the shared trace lives.
DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/traces/mooncake_conversation_trace.jsonl"
)


@dataclass
class Workload:
    name: str
    description: str
    #: (worker, raw msgpack batch, blocks stored in it, events in it), in order.
    batches: list[tuple[int, bytes, int, int]] = field(default_factory=list)
    queries: list[np.ndarray] = field(default_factory=list)
    scans: list[np.ndarray] = field(default_factory=list)
    #: (block, worker) pairs resident at the end (= distinct blocks with one worker).
    resident_blocks: int = 0

    @property
    def blocks(self) -> int:
        return sum(b[2] for b in self.batches)

    @property
    def events(self) -> int:
        return sum(b[3] for b in self.batches)


def block_tokens(block_id: int) -> np.ndarray:
    """16 synthetic token ids that stand for one trace block."""
    base = (block_id * 7919) & TOKEN_MASK
    return (np.arange(BLOCK_SIZE, dtype=np.int64) + base) & TOKEN_MASK


def request_tokens(block_ids: list[int]) -> np.ndarray:
    if not block_ids:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([block_tokens(b) for b in block_ids])


#: The namespace of an unregistered source (model "", tokenizer ""), as the index sees it.
NS = namespace_id(block_size=BLOCK_SIZE)


def keys_of(block_ids: list[int]) -> np.ndarray:
    return np.asarray(content_keys(request_tokens(block_ids), BLOCK_SIZE, NS), dtype=np.uint64)


def stored(keys: np.ndarray, tokens: np.ndarray, parent: int | None) -> enc.BlockStored:
    return enc.BlockStored(
        block_hashes=[int(k) for k in keys],
        parent_block_hash=parent,
        token_ids=tokens.tolist(),
        block_size=BLOCK_SIZE,
    )


def seed(queries: int = 20_000, progress: Callable[[int], None] | None = None) -> Workload:
    """2,000 requests x (16 shared + 4 unique) blocks, all stored, one worker."""
    w = Workload(
        "seed",
        "original study: 2,000 requests x (16 shared + 4 unique) blocks, 1 worker, "
        "40,000 puts, 8,016 resident",
    )
    shared = list(range(16))
    rng = random.Random(1)
    requests = []
    for r in range(2000):
        ids = shared + [1_000 + r * 4 + j for j in range(4)]
        keys = keys_of(ids)
        requests.append(keys)
        ev = stored(keys, request_tokens(ids), None)
        w.batches.append((0, enc.encode_batch([ev], ts=float(r)), 20, 1))
        if progress:
            progress(1)
    w.queries = [requests[rng.randrange(2000)] for _ in range(queries)]
    w.scans = [requests[rng.randrange(2000)][: rng.randint(17, 20)] for _ in range(queries)]
    w.resident_blocks = 16 + 2000 * 4
    return w


class _LruWorker:
    """A vLLM-like prefix cache: stores only missed blocks, evicts LRU beyond capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()

    def admit(self, keys: np.ndarray, tokens: np.ndarray) -> tuple[list[enc.Event], int]:
        hit = 0
        for k in keys:
            if int(k) in self.cache:
                hit += 1
            else:
                break
        for k in keys[:hit]:
            self.cache.move_to_end(int(k))
        events: list[enc.Event] = []
        new = keys[hit:]
        if len(new) == 0:
            return events, 0
        evicted = []
        while len(self.cache) + len(new) > self.capacity and self.cache:
            evicted.append(self.cache.popitem(last=False)[0])
        if evicted:
            events.append(enc.BlockRemoved(block_hashes=evicted))
        parent = int(keys[hit - 1]) if hit else None
        events.append(stored(new, tokens[hit * BLOCK_SIZE : len(keys) * BLOCK_SIZE], parent))
        for k in new:
            self.cache[int(k)] = None
        return events, len(new)


def _replay(
    w: Workload,
    requests: Iterator[tuple[int, list[int]]],
    workers: int,
    capacity: int,
    queries: int,
    rng: random.Random,
    progress: Callable[[int], None] | None,
) -> Workload:
    caches = [_LruWorker(capacity) for _ in range(workers)]
    seen: list[np.ndarray] = []
    for i, (worker, ids) in enumerate(requests):
        keys = keys_of(ids)
        events, n = caches[worker].admit(keys, request_tokens(ids))
        if events:
            payload = enc.encode_batch(events, ts=float(i))
            w.batches.append((worker, payload, n, len(events)))
        if len(seen) < 50_000:
            seen.append(keys)
        elif rng.random() < 0.1:
            seen[rng.randrange(len(seen))] = keys
        if progress:
            progress(1)
    w.resident_blocks = sum(len(c.cache) for c in caches)
    w.queries = [seen[rng.randrange(len(seen))] for _ in range(queries)]
    w.scans = []
    # The subtree under a request's last or last-but-one block, and never under its
    # first block alone: in the Mooncake trace every request starts with the same
    # block, so a 1-block prefix is the whole index (a 1- or 2-block request picked
    # there made each such scan build ~10^5 Python entries, and the run never ended).
    deep = [k for k in seen if len(k) >= 2] or seen
    for _ in range(queries):
        k = deep[rng.randrange(len(deep))]
        w.scans.append(k[: rng.randint(max(2, len(k) - 1), len(k))] if len(k) >= 2 else k)
    return w


def synthetic(
    requests: int = 20_000,
    workers: int = 8,
    capacity: int = 50_000,
    queries: int = 20_000,
    families: int = 100,
    seed_: int = 7,
    progress: Callable[[int], None] | None = None,
) -> Workload:
    """Zipf-popular shared prefixes (8-64 blocks) + unique tails (2-16 blocks)."""
    rng = random.Random(seed_)
    prefixes = [
        [10_000_000 + f * 100 + j for j in range(rng.randint(8, 64))] for f in range(families)
    ]
    weights = [1.0 / (f + 1) ** 1.1 for f in range(families)]

    def gen() -> Iterator[tuple[int, list[int]]]:
        for r in range(requests):
            f = rng.choices(range(families), weights)[0]
            tail = [20_000_000 + r * 16 + j for j in range(rng.randint(2, 16))]
            yield (f + r) % workers if rng.random() < 0.2 else f % workers, prefixes[f] + tail

    w = Workload(
        "synthetic",
        f"{requests:,} requests, {families} Zipf(1.1) prefix families of 8-64 blocks + "
        f"2-16 unique, {workers} workers, LRU capacity {capacity:,} blocks each",
    )
    return _replay(w, gen(), workers, capacity, queries, rng, progress)


def mooncake_requests(path: Path) -> list[list[int]]:
    with path.open() as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


def mooncake(
    path: Path = DEFAULT_TRACE,
    workers: int = 8,
    capacity: int = 10_000,
    queries: int = 20_000,
    progress: Callable[[int], None] | None = None,
    requests: list[list[int]] | None = None,
) -> Workload:
    """The Mooncake conversation trace over `workers` LRU caches (routed by the
    request's second block, so a conversation's turns meet their prefix)."""
    reqs = requests if requests is not None else mooncake_requests(path)
    rng = random.Random(3)

    def gen() -> Iterator[tuple[int, list[int]]]:
        for ids in reqs:
            yield (ids[1] if len(ids) > 1 else 0) % workers, ids

    w = Workload(
        "mooncake",
        f"Mooncake conversation trace ({len(reqs):,} requests), {workers} workers, "
        f"LRU capacity {capacity:,} blocks each",
    )
    return _replay(w, gen(), workers, capacity, queries, rng, progress)
