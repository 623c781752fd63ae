"""The simulated engine in real time: the simulator's engine model (`quillcache.sim.engine`,
vLLM's block pool and scheduler) driven step by step by the wall clock.

Each step lasts what the cost model says it would on the modelled GPU (times
`time_scale`; 0 = as fast as possible), so a request's time to first token depends
on how much of its prompt is cached, exactly as in the simulator. After every step
the model's KV events go out as one batch (vLLM publishes once per step) and every
running request receives the tokens it produced.

The model keys its cache by QuillCache content keys; a request's namespace includes
its LoRA adapter and `cache_salt`, so tenants never share blocks in the engine either.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import xxhash

from quillcache import _native
from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.enginesim.lmcache import LmcacheCpuTier
from quillcache.enginesim.sglang import sglang_batch
from quillcache.enginesim.vllm_hashes import HASH_ALGORITHMS, VllmHasher
from quillcache.errors import ConfigError
from quillcache.events.encode import AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from quillcache.events.sglang import wire_of as sglang_wire_of
from quillcache.identity import content_keys, namespace
from quillcache.sim.engine import EngineModel, Running, engine_hash
from quillcache.sim.requests import SimRequest
from quillcache.tokenization.multimodal import HashAlgorithm, MmBlocks

Publish = Callable[[bytes], object]  # what a publisher returns (its seq) is not used


def _events_of(
    raw_events: list[dict[str, Any]],
) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The event objects of a model batch's events as msgpack decodes them."""
    events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
    for raw in raw_events:
        ev = dict(raw)
        kind = ev.pop("type")
        if kind == "BlockStored":
            events.append(BlockStored(**ev))
        elif kind == "BlockRemoved":
            events.append(BlockRemoved(**ev))
        else:
            events.append(AllBlocksCleared())
    return events


class EngineRequestError(ValueError):
    """A request this engine can never serve (e.g. larger than its whole KV cache)."""


@dataclass
class EngineConfig:
    model: str = "sim-model"
    block_size: int = 16
    num_gpu_blocks: int = 4096
    max_num_seqs: int = 256
    max_model_len: int = 8192
    time_scale: float = 1.0
    cost: CostModelConfig | None = None  # None: the cost model's defaults
    lora_modules: list[str] = field(default_factory=list)
    # (TTFT, ITL) seconds for every request, bypassing the model (see `_fixed`)
    fixed_latency_s: tuple[float, float] | None = None
    # `--flavor sglang`: the SGLang release whose KV-event format is published (None:
    # vLLM's); see `quillcache.events.sglang`
    sglang_release: str | None = None
    # `--lmcache`: LMCache's connector ("vllm" or "mp") whose CPU-tier events this engine
    # also publishes (None: no LMCache); see `quillcache.enginesim.lmcache`
    lmcache: str | None = None
    lmcache_chunk_size: int = 256
    lmcache_cpu_chunks: int = 1024
    # `--kv-groups`: KV-cache groups the engine publishes, as vLLM does for a hybrid model
    # (group 0 full attention, the others sliding window of `kv_group_window` tokens);
    # every group mirrors the one cache (dense, evicted together). 1: no group named.
    kv_groups: int = 1
    kv_group_window: int = 4096
    # `--prefix-caching-hash-algo`: whose block hashes the events carry ("xxh3_64_sim":
    # the model's own; "sha256_cbor" / "sha256": vLLM's), see `vllm_hashes`
    prefix_caching_hash_algo: str = "xxh3_64_sim"
    # `--hash-seed`: vLLM's PYTHONHASHSEED, NONE_HASH's seed (None: unset)
    hash_seed: str | None = None
    # `--mm-hasher-algorithm`: vLLM's hash of an image (quillcache.tokenization.multimodal)
    mm_hasher_algorithm: HashAlgorithm = "blake3"

    def __post_init__(self) -> None:
        # a NaN scale killed the engine loop on its first request while /health said 200
        if not (math.isfinite(self.time_scale) and self.time_scale >= 0):
            raise ConfigError(f"time_scale must be a finite number >= 0, got {self.time_scale}")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")


@dataclass
class Admission:
    prompt_tokens: int
    cached_tokens: int


@dataclass
class _Stream:
    run: Running
    tokens: asyncio.Queue[int | None]  # output tokens produced so far; None = finished
    admitted: bool = False
    finished: bool = False
    on_admitted: Callable[[Admission], None] | None = None


class SimEngine:
    """One engine rank. Single-threaded: use it from the event loop only."""

    def __init__(
        self, config: EngineConfig, publish: Publish | None = None, dp_rank: int = 0
    ) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self._publish = publish or (lambda payload: None)
        self._sglang = sglang_wire_of(config.sglang_release) if config.sglang_release else None
        if config.lmcache and config.sglang_release:
            raise ValueError("LMCache's events are modelled for vLLM engines only")
        self.lmcache = (
            LmcacheCpuTier(
                config.lmcache,
                config.lmcache_chunk_size,
                config.lmcache_cpu_chunks,
                config.block_size,
            )
            if config.lmcache
            else None
        )
        if config.prefix_caching_hash_algo != HASH_ALGORITHMS[0] and config.sglang_release:
            raise ValueError("--prefix-caching-hash-algo is vLLM's; SGLang hashes its own way")
        self._vllm_hashes = (
            VllmHasher(config.prefix_caching_hash_algo, config.hash_seed, 4 * config.num_gpu_blocks)
            if config.prefix_caching_hash_algo != HASH_ALGORITHMS[0]
            else None
        )
        self._offloaded: set[int] = set()  # requests whose prompt LMCache has stored
        cost = CostModel(config.cost)
        self.model = EngineModel(
            0,
            capacity_blocks=config.num_gpu_blocks,
            block_size=config.block_size,
            cost=cost,
            max_num_seqs=config.max_num_seqs,
            dp_rank=dp_rank,
        )
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # engine hash -> (LoRA, cache_salt, is block 0) of blocks of LoRA / salted requests:
        # the model's events carry token ids only, vLLM's also carry these (see _tag)
        self._tags: collections.OrderedDict[int, tuple[str, str, bool]] = collections.OrderedDict()
        # engine hash -> the block's multimodal items (identifier, offset), as vLLM's
        # events list them after the adapter name
        self._mm_tags: collections.OrderedDict[int, list[tuple[str, int]]] = (
            collections.OrderedDict()
        )
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which cached
        self.requests_total = 0
        self.finished_total = 0  # ran to max_tokens
        self.aborted_total = 0  # closed early: the client went away (vLLM's "abort")

    # -- state for /metrics ----------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self.model.running)

    @property
    def waiting(self) -> int:
        return len(self.model.waiting)

    @property
    def kv_usage(self) -> float:
        return self.model.kv_usage

    # -- requests --------------------------------------------------------------------

    def check(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise `EngineRequestError` for a request that could never be admitted."""
        bs = self.config.block_size
        needed = -(-(prompt_tokens + max(max_tokens, 1)) // bs)
        room = self.config.num_gpu_blocks - len(self.model.pinned)
        if needed > room:
            raise EngineRequestError(
                f"the request needs {needed} KV blocks; this engine has {room}"
            )

    def _request(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        salt: str,
        lora: str,
        mm: MmBlocks | None = None,
    ) -> SimRequest:
        bs = self.config.block_size
        ns = namespace(self.config.model, "", lora, salt, bs)
        if mm is None:
            keys = content_keys(prompt, bs, ns)
        else:
            arr = np.asarray(prompt, dtype=np.uint32)
            keys = np.asarray(_native.content_keys(arr, bs, ns, mm=mm), dtype=np.uint64)
        req = SimRequest(
            rid=next(self._ids),
            arrival_s=time.monotonic(),
            prompt_tokens=len(prompt),
            output_tokens=max(max_tokens, 1),
            keys=keys,
            block_size=bs,
            tokens=np.asarray(prompt, dtype=np.uint32),
            keys_list=keys.tolist(),
        )
        if salt or lora:
            for i, key in enumerate(req.keys_list):
                h = engine_hash(key, self.model.salt)
                self._tags[h] = (lora, salt, i == 0)
                self._tags.move_to_end(h)
            while len(self._tags) > 4 * self.config.num_gpu_blocks:
                self._tags.popitem(last=False)
        for i, items in enumerate(mm or ()):
            if items:
                h = engine_hash(int(keys[i]), self.model.salt)
                self._mm_tags[h] = list(items)
                self._mm_tags.move_to_end(h)
        while len(self._mm_tags) > 4 * self.config.num_gpu_blocks:
            self._mm_tags.popitem(last=False)
        if not self.model.fits_ever(req):
            raise EngineRequestError(
                f"the request needs {self.model.blocks_needed(req)} KV blocks; "
                f"this engine has {self.config.num_gpu_blocks}"
            )
        return req

    async def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        next_token: Callable[[int], int],
        *,
        salt: str = "",
        lora: str = "",
        on_admitted: Callable[[Admission], None] | None = None,
        mm: MmBlocks | None = None,
    ) -> AsyncIterator[int]:
        """Yield `max_tokens` generated ids as the engine produces them; closing the
        generator early aborts the request and frees its blocks."""
        if self.config.fixed_latency_s is not None:
            async for token in self._fixed(prompt, max_tokens, next_token, on_admitted):
                yield token
            return
        req = self._request(prompt, max_tokens, salt, lora, mm)
        self.requests_total += 1
        run = self.model.enqueue(req, self._lmcache_blocks(prompt))
        stream = _Stream(run, asyncio.Queue(), on_admitted=on_admitted)
        self._streams[req.rid] = stream
        self._ensure_loop()
        produced = 0
        try:
            while produced < max_tokens:
                available = await stream.tokens.get()
                if available is None:
                    break
                while produced < min(available, max_tokens):
                    yield next_token(produced)
                    produced += 1
            while not stream.finished and max_tokens == 0:  # wait for the prefill anyway
                if await stream.tokens.get() is None:
                    break
        finally:
            if not stream.finished:
                self._abort(stream)
            else:
                self.finished_total += 1
            self._streams.pop(req.rid, None)

    def _lmcache_blocks(self, prompt: Sequence[int]) -> int:
        """The prompt's leading blocks LMCache's CPU tier holds: vLLM's connector loads
        them instead of computing them (beyond its own GPU hit; counted in
        `cached_tokens`). LMCache keys chunks by tokens alone, not by vLLM's cache_salt."""
        if self.lmcache is None:
            return 0
        tokens, _ = self.lmcache.lookup(prompt)
        return tokens // self.config.block_size

    async def _fixed(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        next_token: Callable[[int], int],
        on_admitted: Callable[[Admission], None] | None,
    ) -> AsyncIterator[int]:
        """A steady upstream: a request's latency depends on its prompt only, never on
        the load (no queueing, no batching, no cache, no events), so that a proxy in
        front of it is the only difference between two runs of the same workload.

        Each prompt gets the configured TTFT and ITL times a factor in [1, 2) drawn from
        its hash: concurrent clients would otherwise move in lockstep (all 64 streams
        asking, and then relaying a token, in the same millisecond)."""
        ttft_s, itl_s = self.config.fixed_latency_s or (0.0, 0.0)
        digest = xxhash.xxh3_64_intdigest(np.asarray(prompt, dtype=np.uint32).tobytes())
        factor = 1.0 + digest / 2**64
        ttft_s, itl_s = ttft_s * factor, itl_s * factor
        self.requests_total += 1
        if on_admitted is not None:
            on_admitted(Admission(len(prompt), 0))
        done = False
        try:
            await asyncio.sleep(ttft_s)
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(itl_s)
                yield next_token(i)
            done = True
        finally:
            if done:
                self.finished_total += 1
            else:
                self.aborted_total += 1

    def _abort(self, stream: _Stream) -> None:
        """The client went away: drop the request from the scheduler, free its blocks."""
        self.aborted_total += 1
        m, run = self.model, stream.run
        if run in m.waiting:
            m.waiting.remove(run)
            m.queued_prefill_tokens -= max(run.req.prompt_tokens - run.hit_blocks * m.block_size, 1)
        elif run in m.running:
            m.running.remove(run)
            m.queued_prefill_tokens -= max(run.req.prompt_tokens - run.computed, 0)
            m._finish(run)
        stream.finished = True
        self._flush_events()

    # -- the step loop ---------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())
        self._wake.set()

    async def _loop(self) -> None:
        m, scale = self.model, self.config.time_scale
        while True:
            if not m.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            step_s, _, chunks, decoders = m.plan_step()
            self._note_admissions()
            if not chunks and not decoders:  # nothing admissible: wait for a change
                self._flush_events()
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(step_s * scale)
            done = m.apply_step(time.monotonic(), 1, chunks, decoders, step_s)
            self._offload(run for run, _ in chunks)
            self._flush_events()
            for run in itertools.chain((r for r, _ in chunks), decoders):
                stream = self._streams.get(run.req.rid)
                if stream is not None and run.output_done:
                    stream.tokens.put_nowait(run.output_done)
            for run in done:
                stream = self._streams.get(run.req.rid)
                if stream is not None:
                    stream.finished = True
                    stream.tokens.put_nowait(None)
                self._offloaded.discard(run.req.rid)

    def _note_admissions(self) -> None:
        bs = self.config.block_size
        for run in self.model.running:
            stream = self._streams.get(run.req.rid)
            if stream is None or stream.admitted:
                continue
            stream.admitted = True
            cached = min(run.hit_blocks * bs, run.req.prompt_tokens)
            self.prefix_queries += run.req.prompt_tokens
            self.prefix_hits += cached
            if stream.on_admitted is not None:
                stream.on_admitted(Admission(run.req.prompt_tokens, cached))

    def _offload(self, prefilled: Iterable[Running]) -> None:
        """LMCache stores each prompt whose prefill this step completed."""
        if self.lmcache is None:
            return
        for run in prefilled:
            if run.computed >= run.req.prompt_tokens and run.req.rid not in self._offloaded:
                self._offloaded.add(run.req.rid)
                assert run.req.tokens is not None  # the engine simulator always has them
                self.lmcache.store(run.req.tokens.tolist())

    def _flush_events(self) -> None:
        ts = time.time()
        payload = self.model.drain_events(ts)
        offloaded = self.lmcache.drain() if self.lmcache is not None else []
        if offloaded:  # vLLM publishes its connector's events in the step's batch
            ts, events, rank = (ts, [], self.dp_rank)
            if payload:
                ts, raw, rank = msgpack.unpackb(self.wire_out(payload))
                events = _events_of(raw)
            self._publish(encode_batch([*events, *offloaded], ts=ts, dp_rank=rank))
        elif payload:
            self._publish(self.wire_out(payload))

    def wire_out(self, payload: bytes) -> bytes:
        """A batch of the model (vLLM's format) as this engine publishes it: with vLLM's
        LoRA / salt tags, or in the configured SGLang release's format."""
        if self._sglang is not None:
            return sglang_batch(payload, self._sglang, self._tags)
        if self._vllm_hashes is not None:
            out = self._rehash(payload)
        else:
            out = self._tag(payload) if self._tags or self._mm_tags else payload
        return self._per_group(out) if self.config.kv_groups > 1 else out

    def _per_group(self, payload: bytes) -> bytes:
        """Each store and removal once per KV-cache group, as vLLM 0.34 publishes a
        hybrid model's (`BlockPool.cache_full_blocks` per group, the spec kind and window
        added by `KVCacheManager.take_events`; removals name their group only)."""
        ts, raw_events, rank = msgpack.unpackb(payload)
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for ev in _events_of(raw_events):
            if isinstance(ev, AllBlocksCleared):
                out.append(ev)
                continue
            for g in range(self.config.kv_groups):
                if isinstance(ev, BlockRemoved):
                    out.append(dataclasses.replace(ev, group_idx=g))
                    continue
                swa = g > 0
                out.append(
                    dataclasses.replace(
                        ev,
                        group_idx=g,
                        kv_cache_spec_kind="sliding_window" if swa else "full_attention",
                        kv_cache_spec_sliding_window=self.config.kv_group_window if swa else None,
                    )
                )
        return encode_batch(out, ts=ts, dp_rank=rank)

    def _rehash(self, payload: bytes) -> bytes:
        """Tag the batch (`_tag`), then give its blocks vLLM's hashes (`--prefix-caching-
        hash-algo`); the tags are looked up by the model's hashes, before the rewrite."""
        assert self._vllm_hashes is not None
        tagged = self._tag(payload) if self._tags or self._mm_tags else payload
        ts, raw_events, rank = msgpack.unpackb(tagged)
        self._vllm_hashes.rewrite(raw_events, self._tags, self._mm_tags)
        return encode_batch(_events_of(raw_events), ts=ts, dp_rank=rank)

    def _tag(self, payload: bytes) -> bytes:
        """Add what vLLM's BlockStored carries for LoRA / salted / multimodal requests:
        `lora_name`, and per block `extra_keys` in vLLM's order (the adapter name, each
        image's `[identifier, offset]`, `cache_salt` on block 0). The index derives the
        namespace and the blocks' items from them, as the gateway does from the request."""
        ts, raw_events, rank = msgpack.unpackb(payload)
        changed = False
        for ev in raw_events:
            if ev["type"] == "BlockStored":
                tags = [self._tags.get(h) for h in ev["block_hashes"]]
                mms = [self._mm_tags.get(h) for h in ev["block_hashes"]]
                if any(tags) or any(mms):
                    changed = True
                    lora = next((t[0] for t in tags if t), "")
                    ev["lora_name"] = lora or None
                    ev["extra_keys"] = [
                        (
                            ([t[0]] if t and t[0] else [])
                            + [[ident, off] for ident, off in mm or ()]
                            + ([t[1]] if t and t[1] and t[2] else [])
                        )
                        or None
                        for t, mm in zip(tags, mms, strict=True)
                    ]
        return encode_batch(_events_of(raw_events), ts=ts, dp_rank=rank) if changed else payload

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block that no request uses (vLLM refuses while busy)."""
        m = self.model
        if m.running or m.waiting:
            return False
        m.free.clear()
        m.cpu.clear()
        self._flush_events()
        cleared = encode_batch([AllBlocksCleared()], ts=time.time(), dp_rank=self.dp_rank)
        self._publish(self.wire_out(cleared))
        return True
