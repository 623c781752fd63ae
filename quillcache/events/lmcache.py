"""LMCache's residency as a vLLM engine publishes it, connector by connector, and the
events that say it (the engine simulator's `--lmcache`; the tests).

LMCache (0.5.6, read from its wheel) sends nothing a gateway can subscribe to: its
vLLM connectors hand its `CacheStoreEvent` / `CacheRemoveEvent` (`lmcache/utils.py`)
to vLLM, which publishes them as `BlockStored` / `BlockRemoved` on the engine's own
KV-event socket, in vLLM's format, next to its GPU events. So QuillCache reads LMCache
through the engine subscription every gateway replica already has (docs/kv-events.md,
"LMCache"; golden frames made by LMCache's and vLLM's code:
`tests/vectors/lmcache_kv_events.json`). What each connector sends:

==========  ==============================================================
``vllm``    LMCache inside the vLLM process, vLLM's ``LMCacheConnectorV1``:
            one BlockStored per stored chunk (`lmcache/v1/cache_engine.py`,
            ``store``), medium ``"cpu"``, ``block_size`` = the chunk's token
            count (the last chunk of a prompt may be short); no removals.
``mp``      LMCache's multiprocess server, LMCache's ``LMCacheMPConnector``:
            the server's CPU (L1) stores and evictions, one chunk per event,
            medium ``"CPU"``, ``block_size`` = the LMCache chunk size; every
            announced chunk is withdrawn when the server restarts or reports
            lost events.
==========  ==============================================================

Both report LMCache's CPU tier only (its disk and remote backends are seen by its
cache controller alone). Each event's one hash is LMCache's chunk hash, not vLLM's
block hash: an opaque id, as every engine hash is to QuillCache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from quillcache.events.types import BlockRemoved, BlockStored, EngineHash

#: LMCache's default chunk size (`lmcache/v1/config.py`, ``chunk_size``).
DEFAULT_CHUNK_SIZE = 256


@dataclass(frozen=True, slots=True)
class LmcacheWire:
    """What one of LMCache's vLLM connectors makes vLLM publish."""

    connector: str
    medium: str  # the medium name on every event
    short_last_chunk: bool  # a prompt's partial last chunk is reported (block_size = its length)
    removals: bool  # evictions are reported as BlockRemoved
    # A store that skips chunks LMCache already holds names parent 0 for its first new
    # chunk (`LMCacheEngine.store` starts `prev_key` at 0 and sets it only for chunks it
    # reports), not the hash of the chunk before it.
    zero_parent_after_skip: bool


CONNECTORS: dict[str, LmcacheWire] = {
    "vllm": LmcacheWire(
        "vllm", "cpu", short_last_chunk=True, removals=False, zero_parent_after_skip=True
    ),
    "mp": LmcacheWire(
        "mp", "CPU", short_last_chunk=False, removals=True, zero_parent_after_skip=False
    ),
}


def wire_of(connector: str) -> LmcacheWire:
    """The wire of LMCache's connector `connector` ("vllm" or "mp")."""
    try:
        return CONNECTORS[connector]
    except KeyError:
        known = ", ".join(sorted(CONNECTORS))
        raise ValueError(f"unknown LMCache connector {connector!r} (known: {known})") from None


def stored_chunks(
    wire: LmcacheWire,
    tokens: Sequence[int],
    hashes: Sequence[EngineHash],
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    parent: EngineHash | None = None,
) -> list[BlockStored]:
    """The BlockStored events LMCache reports for storing `tokens` from the chunk after
    `parent` on: one per chunk, chained, hashes[i] naming chunk i. Chunks LMCache would
    not report (a short last one, for the mp connector) are left out; `hashes` must
    name every chunk reported."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    starts = range(0, len(tokens), chunk_size)
    reported = [s for s in starts if wire.short_last_chunk or s + chunk_size <= len(tokens)]
    if len(hashes) < len(reported):
        raise ValueError(f"{len(reported)} chunks need as many hashes, got {len(hashes)}")
    events: list[BlockStored] = []
    for start, chunk_hash in zip(reported, hashes, strict=False):
        chunk = tokens[start : start + chunk_size]
        events.append(
            BlockStored(
                block_hashes=[chunk_hash],
                parent_block_hash=parent,
                token_ids=list(chunk),
                block_size=len(chunk) if wire.short_last_chunk else chunk_size,
                medium=wire.medium,
                group_idx=None,  # vLLM's connectors leave it unset
            )
        )
        parent = chunk_hash
    return events


def resumed_parent(wire: LmcacheWire, previous_chunk: EngineHash) -> EngineHash:
    """The parent LMCache names for the first chunk of a store that skipped the chunks
    up to `previous_chunk` (already held)."""
    return 0 if wire.zero_parent_after_skip else previous_chunk


def removed_chunks(wire: LmcacheWire, hashes: Sequence[EngineHash]) -> list[BlockRemoved]:
    """The BlockRemoved LMCache reports for evicting the chunks `hashes` from its CPU
    tier: none for the in-process connector, which reports no evictions."""
    if not wire.removals or not hashes:
        return []
    return [BlockRemoved(block_hashes=list(hashes), medium=wire.medium, group_idx=None)]
