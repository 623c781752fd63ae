"""The simulated engine: a paged prefix cache with LRU eviction, admission control,
and real-time latency, publishing vLLM-format KV events for what it caches and evicts.

Latency follows the cache the way a GPU's does: time to first token grows with the
prompt tokens that are *not* cached (prefill), then one token per `itl_ms`. Every
duration is multiplied by `time_scale` (0 = as fast as possible).
"""

from __future__ import annotations

import asyncio
import collections
import struct
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from quillcache.events.encode import AllBlocksCleared, BlockRemoved, BlockStored, Event

EventSink = Callable[[list[Event]], None]


@dataclass
class EngineConfig:
    model: str = "sim-model"
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 8192
    time_scale: float = 1.0
    step_ms: float = 2.0  # fixed cost of the first step
    prefill_ms_per_1k_tokens: float = 25.0  # per uncached prompt token, x1000
    itl_ms: float = 5.0
    hash_seed: int = 0x5EED
    lora_modules: list[str] = field(default_factory=list)


@dataclass
class Admission:
    prompt_tokens: int
    cached_tokens: int
    block_hashes: list[int]


def _block_hash(seed: int, parent: int, tokens: Sequence[int]) -> int:
    data = struct.pack(f"<Q{len(tokens)}I", parent, *tokens)
    return xxhash.xxh3_64_intdigest(data, seed=seed)


class SimEngine:
    """One engine rank. Single-threaded: call it from the event loop only."""

    def __init__(self, config: EngineConfig, emit: EventSink | None = None) -> None:
        self.config = config
        self._emit = emit or (lambda events: None)
        # engine hash -> None, least recently used first; a cached block may be in use
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._in_use: collections.Counter[int] = collections.Counter()
        self._slots = asyncio.Semaphore(config.max_num_seqs)
        self.running = 0
        self.waiting = 0
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which cached
        self.requests_total = 0

    # -- cache -----------------------------------------------------------------------

    @property
    def kv_usage(self) -> float:
        return len(self._lru) / self.config.num_gpu_blocks

    def _chain(self, tokens: Sequence[int], salt: str, lora: str) -> list[int]:
        b = self.config.block_size
        parent = xxhash.xxh3_64_intdigest(f"{lora}\x00{salt}".encode(), seed=self.config.hash_seed)
        out = []
        for start in range(0, len(tokens) - b + 1, b):
            parent = _block_hash(self.config.hash_seed, parent, tokens[start : start + b])
            out.append(parent)
        return out

    def _store(
        self,
        tokens: Sequence[int],
        hashes: list[int],
        first: int,
        salt: str,
        lora: str,
        events: list[Event],
    ) -> None:
        """Cache blocks `first..` of a chain (the earlier ones are cached), evicting LRU ones."""
        b = self.config.block_size
        new = [i for i in range(first, len(hashes)) if hashes[i] not in self._lru]
        if not new:
            for h in hashes[first:]:
                self._lru.move_to_end(h)
            return
        for h in hashes[:first]:
            self._lru.move_to_end(h)
        evicted = self._make_room(len(new))
        events.extend(BlockRemoved(block_hashes=[h]) for h in evicted)  # vLLM: one per event
        start = new[0]
        if len(self._lru) + len(hashes) - start > self.config.num_gpu_blocks:
            return  # everything is in use: vLLM would preempt; we simply do not cache
        for h in hashes[start:]:
            self._lru[h] = None
            self._lru.move_to_end(h)
        extra: list[list[str] | None] = []
        for i in range(start, len(hashes)):
            keys = [lora] if lora else []
            if i == 0 and salt:
                keys.append(salt)
            extra.append(keys or None)
        events.append(
            BlockStored(
                block_hashes=hashes[start:],
                parent_block_hash=hashes[start - 1] if start else None,
                token_ids=list(tokens[start * b : len(hashes) * b]),
                block_size=b,
                lora_name=lora or None,
                extra_keys=extra if any(e is not None for e in extra) else None,
            )
        )

    def _make_room(self, needed: int) -> list[int]:
        free = self.config.num_gpu_blocks - len(self._lru)
        evicted: list[int] = []
        if free >= needed:
            return evicted
        for h in list(self._lru):
            if free >= needed:
                break
            if self._in_use[h]:
                continue
            del self._lru[h]
            evicted.append(h)
            free += 1
        return evicted

    def admit(self, tokens: Sequence[int], salt: str = "", lora: str = "") -> Admission:
        hashes = self._chain(tokens, salt, lora)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._lru:
            hit += 1
        cached_tokens = hit * self.config.block_size
        if cached_tokens == len(tokens) and hit:  # vLLM always recomputes the last token
            cached_tokens -= self.config.block_size
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached_tokens
        events: list[Event] = []
        self._store(tokens, hashes, hit, salt, lora, events)
        self._in_use.update(h for h in hashes if h in self._lru)
        if events:
            self._emit(events)
        return Admission(len(tokens), cached_tokens, hashes)

    def release(
        self, admission: Admission, all_tokens: Sequence[int], salt: str, lora: str
    ) -> None:
        """A request ended: its blocks become evictable; generated full blocks get cached."""
        self._in_use.subtract(h for h in admission.block_hashes if h in self._lru)
        self._in_use += collections.Counter()  # drop non-positive counts
        hashes = self._chain(all_tokens, salt, lora)
        if len(hashes) > len(admission.block_hashes) and all(
            h in self._lru for h in hashes[: len(admission.block_hashes)]
        ):
            events: list[Event] = []
            self._store(all_tokens, hashes, len(admission.block_hashes), salt, lora, events)
            if events:
                self._emit(events)

    def reset_prefix_cache(self) -> int:
        dropped = len(self._lru)
        self._lru.clear()
        self._in_use.clear()
        self._emit([AllBlocksCleared()])
        return dropped

    # -- requests --------------------------------------------------------------------

    async def _sleep_ms(self, ms: float) -> None:
        await asyncio.sleep(ms * self.config.time_scale / 1000.0)

    async def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        next_token: Callable[[int], int],
        *,
        salt: str = "",
        lora: str = "",
        on_admitted: Callable[[Admission], None] | None = None,
    ) -> AsyncIterator[int]:
        """Yield `max_tokens` generated ids in real time; cancellation frees the slot."""
        self.waiting += 1
        self.requests_total += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        output: list[int] = []
        admission = self.admit(prompt, salt, lora)
        if on_admitted is not None:
            on_admitted(admission)
        try:
            uncached = admission.prompt_tokens - admission.cached_tokens
            await self._sleep_ms(
                self.config.step_ms + uncached * self.config.prefill_ms_per_1k_tokens / 1000
            )
            for i in range(max_tokens):
                if i:
                    await self._sleep_ms(self.config.itl_ms)
                token = next_token(i)
                output.append(token)
                yield token
        finally:
            self.running -= 1
            self._slots.release()
            self.release(admission, [*prompt, *output], salt, lora)
