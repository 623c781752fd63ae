"""LMCache beside a simulated vLLM engine (`engine-sim --lmcache vllm|mp`): the chunks of
every prompt the engine computes stored in LMCache's CPU tier, and reported as LMCache's
connector makes vLLM report them (`quillcache.events.lmcache`, docs/kv-events.md,
"LMCache").

What is modelled is what the events say: LMCache stores a prompt's chunks once its
prefill is computed, skips the chunks it already holds (touching them, LRU), evicts the
least recently used chunk beyond its capacity. Loading chunks back into the GPU (a
shorter prefill on an LMCache hit) is not modelled: the engine's time to first token
does not depend on LMCache here.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import xxhash

from quillcache.events.lmcache import removed_chunks, resumed_parent, stored_chunks, wire_of
from quillcache.events.types import BlockRemoved, BlockStored


class LmcacheCpuTier:
    """LMCache's CPU tier of one engine rank: chunk hashes in LRU order."""

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
        self._chunks: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._pending: list[BlockStored | BlockRemoved] = []
        self.stored_total = 0
        self.evicted_total = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def _hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained chunk hashes (LMCache's prefix hash: a chunk's depends on all before it)."""
        out: list[int] = []
        prev = 0
        for start in range(0, len(tokens), self.chunk_size):
            chunk = np.asarray(tokens[start : start + self.chunk_size], dtype=np.uint32)
            prev = xxhash.xxh3_64_intdigest(prev.to_bytes(8, "big") + chunk.tobytes())
            out.append(prev)
        return out

    def store(self, tokens: Sequence[int]) -> None:
        """LMCache stores a computed prompt: its chunks from the first it does not hold."""
        hashes = self._hashes(tokens)
        if not self.wire.short_last_chunk and len(tokens) % self.chunk_size:
            hashes = hashes[:-1]  # the mp connector reports full chunks only
        skip = 0
        while skip < len(hashes) and hashes[skip] in self._chunks:
            self._chunks.move_to_end(hashes[skip])
            skip += 1
        if skip == len(hashes):
            return
        parent = None if skip == 0 else resumed_parent(self.wire, hashes[skip - 1])
        rest = tokens[skip * self.chunk_size :]
        self._pending += stored_chunks(self.wire, rest, hashes[skip:], self.chunk_size, parent)
        for h in hashes[skip:]:
            self._chunks[h] = None
            self.stored_total += 1
        evicted: list[int] = []
        while len(self._chunks) > self.capacity_chunks:
            evicted.append(self._chunks.popitem(last=False)[0])
        self.evicted_total += len(evicted)
        self._pending += removed_chunks(self.wire, evicted)

    def drain(self) -> list[BlockStored | BlockRemoved]:
        """The events since the last drain, in order (vLLM takes them once per step)."""
        out, self._pending = self._pending, []
        return out
