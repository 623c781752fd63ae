"""The engine simulator's LMCache (`engine-sim --lmcache vllm|mp`): the CPU-tier events it
publishes are LMCache's connectors' shapes (`quillcache.events.lmcache`), and what the
index makes of them, including the in-process connector's parent 0 after skipped
chunks (docs/kv-events.md, "LMCache")."""

from __future__ import annotations

import asyncio

import pytest

from quillcache import _native
from quillcache.enginesim.engine import EngineConfig, SimEngine
from quillcache.enginesim.lmcache import LmcacheCpuTier
from quillcache.events import encode as enc
from quillcache.events import pyref
from quillcache.events.types import BlockRemoved, BlockStored, EventBatch
from quillcache.index import Match, create_backend
from tests.index.helpers import backends, keys

BS = 4


def _decode(events: list[BlockStored | BlockRemoved]) -> EventBatch:
    payload = enc.encode_batch(events, ts=1.0, dp_rank=0)
    decoded = _native.decode_batch(payload)
    assert decoded == pyref.decode_batch(payload)
    return decoded


@pytest.mark.parametrize("connector", ["vllm", "mp"])
def test_a_prompt_is_stored_once_chunk_by_chunk(connector: str) -> None:
    tier = LmcacheCpuTier(connector, chunk_size=8, capacity_chunks=16, block_size=BS)
    prompt = list(range(20))  # two full chunks and a short one
    tier.store(prompt)
    first = _decode(tier.drain()).events
    sizes = [e.block_size for e in first if isinstance(e, BlockStored)]
    assert sizes == ([8, 8, 4] if connector == "vllm" else [8, 8])
    assert all(e.medium == "CPU" for e in first)  # type: ignore[union-attr]
    parents = [e.parent_block_hash for e in first if isinstance(e, BlockStored)]
    hashes = [e.block_hashes[0] for e in first if isinstance(e, BlockStored)]
    assert parents == [None, *hashes[:-1]]
    tier.store(prompt)  # held already: LMCache stores nothing, reports nothing
    assert tier.drain() == []


@pytest.mark.parametrize(("connector", "parent_is_zero"), [("vllm", True), ("mp", False)])
def test_a_longer_prompt_stores_only_its_new_chunks(connector: str, parent_is_zero: bool) -> None:
    tier = LmcacheCpuTier(connector, chunk_size=8, capacity_chunks=16, block_size=BS)
    tier.store(list(range(16)))
    held = [e.block_hashes[0] for e in tier.drain() if isinstance(e, BlockStored)]
    tier.store(list(range(24)))
    (new,) = tier.drain()
    assert isinstance(new, BlockStored)
    assert list(new.token_ids) == list(range(16, 24))
    assert new.parent_block_hash == (0 if parent_is_zero else held[-1])


@pytest.mark.parametrize("connector", ["vllm", "mp"])
def test_evictions_are_reported_by_the_mp_connector_only(connector: str) -> None:
    tier = LmcacheCpuTier(connector, chunk_size=8, capacity_chunks=2, block_size=BS)
    tier.store(list(range(8)))
    tier.store(list(range(100, 116)))
    events = tier.drain()
    first = events[0]
    assert isinstance(first, BlockStored)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(tier) == 2 and tier.evicted_total == 1
    if connector == "mp":
        assert [list(e.block_hashes) for e in removed] == [list(first.block_hashes)]
    else:
        assert removed == []


def test_the_mp_connector_needs_a_chunk_size_multiple_of_the_block_size() -> None:
    with pytest.raises(ValueError, match="multiple of the block size"):
        LmcacheCpuTier("mp", chunk_size=6, capacity_chunks=4, block_size=BS)
    LmcacheCpuTier("vllm", chunk_size=6, capacity_chunks=4, block_size=BS)  # LMCache allows it
    with pytest.raises(ValueError, match="unknown LMCache connector"):
        LmcacheCpuTier("lmcache", chunk_size=8, capacity_chunks=4, block_size=BS)


@pytest.mark.parametrize("name", backends())
def test_chunks_the_size_of_a_block_are_cpu_hits_and_a_resumed_store_is_orphaned(
    name: str,
) -> None:
    """With LMCache's chunk size equal to the engine's block size, its chunks are found by
    requests as a CPU-tier hit in every backend. The in-process connector's store of a
    prompt's new chunks names parent 0 (LMCache's own value): the index counts them as
    orphans and keeps the rest, it does not guess a parent."""
    tier = LmcacheCpuTier("vllm", chunk_size=BS, capacity_chunks=64, block_size=BS)
    index = create_backend(name)
    try:
        index.register_source(1, model="m", tokenizer="")
        tier.store(list(range(3 * BS)))
        index.apply(1, [enc.encode_batch(tier.drain(), ts=1.0, dp_rank=0)])
        assert index.match(keys(list(range(5 * BS)), model="m")) == [Match(1, 0, "CPU", 3)]
        tier.store(list(range(5 * BS)))
        stats = index.apply(1, [enc.encode_batch(tier.drain(), ts=2.0, dp_rank=0)])
        assert stats.orphan_blocks == 2
        assert index.match(keys(list(range(5 * BS)), model="m")) == [Match(1, 0, "CPU", 3)]
    finally:
        index.close()


def test_the_engine_publishes_lmcache_events_in_its_step_batches() -> None:
    """A request through the simulated engine: its batches carry the GPU blocks vLLM's
    model stores and, once the prefill is done, LMCache's chunks of the prompt on the CPU
    tier, both decodable by both decoders."""
    published: list[bytes] = []
    config = EngineConfig(
        block_size=BS, num_gpu_blocks=64, time_scale=0.0, lmcache="mp", lmcache_chunk_size=8
    )

    async def run() -> None:
        engine = SimEngine(config, publish=published.append)
        async for _ in engine.generate(list(range(1000, 1020)), 2, lambda i: i):
            pass

    asyncio.run(run())
    batches = [_native.decode_batch(p) for p in published]
    assert batches == [pyref.decode_batch(p) for p in published]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    cpu = [e for e in stored if e.medium == "CPU"]
    assert {e.medium for e in stored} == {"GPU", "CPU"}
    assert [list(e.token_ids) for e in cpu] == [list(range(1000, 1008)), list(range(1008, 1016))]


def test_lmcache_is_modelled_for_vllm_engines_only() -> None:
    with pytest.raises(ValueError, match="vLLM engines only"):
        SimEngine(EngineConfig(lmcache="mp", lmcache_chunk_size=16, sglang_release="0.5.23"))
