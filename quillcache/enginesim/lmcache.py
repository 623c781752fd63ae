"""LMCache beside a simulated vLLM engine (`engine-sim --lmcache vllm|mp`): the chunks of
every prompt the engine computes stored in LMCache's CPU tier, and reported as LMCache's
connector makes vLLM report them (`quillcache.events.lmcache`, docs/kv-events.md,
"LMCache").

What is modelled is what the events say: LMCache stores a prompt's chunks once its
prefill is computed, skips the chunks it already holds (touching them, LRU), evicts the
least recently used chunk beyond its capacity. A request whose prompt starts with
chunks the tier holds beyond what the GPU holds loads them instead of computing them
(`lookup`, vLLM's connector asking LMCache; counted in `cached_tokens`, as vLLM counts a
connector's hits).

What LMCache's cache controller does to one instance (`lmcache_controller.py` serves its
HTTP API; LMCache 0.5.6, `lmcache/v1/cache_engine.py` and
`lmcache/v1/storage_backend/local_cpu_backend.py`) is here too: a pin count per chunk
(`pin`; a pinned chunk is neither evicted nor cleared), chunks received from a peer
(`receive`, P2P: stored without any KV event, since only `LMCacheEngine.store` makes
them), chunks dropped by a move (`remove`) and `clear`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import xxhash

from quillcache.events.lmcache import removed_chunks, resumed_parent, stored_chunks, wire_of
from quillcache.events.types import BlockRemoved, BlockStored

#: The name LMCache gives its CPU tier (`CreateStorageBackends`), its controller's `location`.
CPU_LOCATION = "LocalCPUBackend"


def chunk_hashes(tokens: Sequence[int], chunk_size: int) -> list[int]:
    """Chained chunk hashes (LMCache's prefix hash: a chunk's depends on all before it),
    a short last chunk included."""
    out: list[int] = []
    prev = 0
    for start in range(0, len(tokens), chunk_size):
        chunk = np.asarray(tokens[start : start + chunk_size], dtype=np.uint32)
        prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "big") + chunk.tobytes())
        out.append(prev)
    return out


class LmcacheCpuTier:
    """LMCache's CPU tier of one engine rank: chunk hashes (and their token counts) in
    LRU order, with pin counts."""

    def __init__(
        self, connector: str, chunk_size: int, capacity_chunks: int, block_size: int
    ) -> None:
        self.wire = wire_of(connector)
        if chunk_size < 1 or capacity_chunks < 1:
            raise ValueError("the LMCache chunk size and capacity must be at least 1")
        if connector == "mp" and chunk_size % block_size:
            # LMCacheMPWorkerAdapter refuses to start with such a chunk size
            raise ValueError(
                f"LMCache's chunk size {chunk_size} must be a multiple of the block size "
                f"{block_size} with the mp connector"
            )
        self.chunk_size = chunk_size
        self.capacity_chunks = capacity_chunks
        self._chunks: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._pins: collections.Counter[int] = collections.Counter()
        self._pending: list[BlockStored | BlockRemoved] = []
        self.stored_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def __contains__(self, chunk_hash: int) -> bool:
        return chunk_hash in self._chunks

    def _hashes(self, tokens: Sequence[int]) -> list[int]:
        """The chunks LMCache keys `tokens` by (the mp connector: full chunks only)."""
        hashes = chunk_hashes(tokens, self.chunk_size)
        if not self.wire.short_last_chunk and len(tokens) % self.chunk_size:
            hashes = hashes[:-1]
        return hashes

    def _length(self, tokens: Sequence[int], i: int) -> int:
        return min(self.chunk_size, len(tokens) - i * self.chunk_size)

    def store(self, tokens: Sequence[int]) -> None:
        """LMCache stores a computed prompt: its chunks from the first it does not hold."""
        hashes = self._hashes(tokens)
        skip = 0
        while skip < len(hashes) and hashes[skip] in self._chunks:
            self._chunks.move_to_end(hashes[skip])
            skip += 1
        if skip == len(hashes):
            return
        parent = None if skip == 0 else resumed_parent(self.wire, hashes[skip - 1])
        rest = tokens[skip * self.chunk_size :]
        self._pending += stored_chunks(self.wire, rest, hashes[skip:], self.chunk_size, parent)
        for i in range(skip, len(hashes)):
            self._chunks[hashes[i]] = self._length(tokens, i)
            self.stored_total += 1
        self._evict()

    def _evict(self) -> None:
        """Least recently used unpinned chunks out, beyond the capacity (a pinned chunk
        cannot be evicted: LMCache's `can_evict`)."""
        over = len(self._chunks) - self.capacity_chunks
        if over <= 0:
            return
        evicted = [h for h in self._chunks if not self._pins[h]][:over]
        for h in evicted:
            del self._chunks[h]
        self.evicted_total += len(evicted)
        self._pending += removed_chunks(self.wire, evicted)

    def lookup(self, tokens: Sequence[int], *, pin: bool = False) -> tuple[int, list[int]]:
        """LMCache's `lookup`: the prompt's leading tokens the tier holds, chunk by chunk
        to the first it does not, and those chunks, touched (most recently used) and,
        with `pin`, given one more pin each."""
        hashes = self._hashes(tokens)
        hit: list[int] = []
        end = 0
        for i, h in enumerate(hashes):
            if h not in self._chunks:
                break
            self._chunks.move_to_end(h)
            hit.append(h)
            end += self._length(tokens, i)
        if pin:
            self._pins.update(hit)
        return end, hit

    def pinned(self, chunk_hash: int) -> int:
        return self._pins[chunk_hash]

    def receive(self, tokens: Sequence[int]) -> int:
        """Chunks of `tokens` sent by a peer (LMCache's P2P put, `_handle_batched_lookup_and_put`
        in `p2p_backend.py`): those not held are stored, most recently used; no KV event
        (LMCache makes them in `store` only). The number of chunks stored."""
        stored = 0
        for i, h in enumerate(self._hashes(tokens)):
            if h in self._chunks:
                continue
            self._chunks[h] = self._length(tokens, i)
            stored += 1
        self.stored_total += stored
        self._evict()
        return stored

    def remove(self, hashes: Sequence[int]) -> None:
        """Drop these chunks (a move without copy); the in-process connector reports it
        to nobody, the mp connector as evictions."""
        gone = [h for h in hashes if self._chunks.pop(h, None) is not None]
        for h in gone:
            self._pins.pop(h, None)
        self._pending += removed_chunks(self.wire, gone)

    def clear(self) -> int:
        """LMCache's `LocalCPUBackend.clear`: every chunk that can be evicted (pinned ones
        stay) is dropped; the tokens they held."""
        gone = [h for h in self._chunks if not self._pins[h]]
        tokens = sum(self._chunks[h] for h in gone)
        for h in gone:
            del self._chunks[h]
        self._pending += removed_chunks(self.wire, gone)
        return tokens

    def drain(self) -> list[BlockStored | BlockRemoved]:
        """The events since the last drain, in order (vLLM takes them once per step)."""
        out, self._pending = self._pending, []
        return out
