"""Hypothesis strategies: event batches as the encoder writes them, with the decoded
value each decoder must return (computed independently of both decoders)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from quillcache.events import encode as enc
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    MmKey,
    normalize_medium,
)

U64 = (1 << 64) - 1

wire_hashes = st.one_of(
    st.integers(0, U64),
    st.integers(-(1 << 63), -1),
    st.binary(min_size=8, max_size=32),
)
media = st.sampled_from([None, "GPU", "CPU", "cpu", "CPU_PINNED", "STORAGE", "DISK", "EXTERNAL"])
texts = st.text(max_size=8)
extra_items = st.one_of(texts, st.tuples(texts, st.integers(-(1 << 63), (1 << 63) - 1)))
groups = st.one_of(st.none(), st.integers(0, (1 << 32) - 1))


def _hash_value(h: int | bytes) -> int:
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h & U64


def _extra(item: str | tuple[str, int]) -> str | MmKey:
    return item if isinstance(item, str) else MmKey(*item)


@st.composite
def stored(draw: st.DrawFn) -> tuple[enc.Event, Event]:
    hashes = draw(st.lists(wire_hashes, max_size=4))
    extra = draw(st.none() | st.lists(st.none() | st.lists(extra_items, max_size=3), max_size=4))
    wire = enc.BlockStored(
        block_hashes=hashes,
        parent_block_hash=draw(st.none() | wire_hashes),
        token_ids=draw(st.lists(st.integers(0, (1 << 32) - 1), max_size=40)),
        block_size=draw(st.integers(1, 256)),
        lora_id=draw(st.none() | st.integers(-(1 << 63), (1 << 63) - 1)),
        medium=draw(media),
        lora_name=draw(st.none() | texts),
        extra_keys=extra,
        group_idx=draw(groups),
        session_id=draw(st.none() | texts),
        lookahead_token_ids=draw(st.none() | st.lists(st.lists(st.integers(0, 99)), max_size=2)),
        cache_salt=draw(st.none() | texts),
    )
    decoded = BlockStored(
        block_hashes=tuple(_hash_value(h) for h in hashes),
        parent_block_hash=None
        if wire.parent_block_hash is None
        else _hash_value(wire.parent_block_hash),
        token_ids=tuple(wire.token_ids),
        block_size=wire.block_size,
        lora_id=wire.lora_id,
        medium=normalize_medium(wire.medium),
        lora_name=wire.lora_name,
        extra_keys=tuple(None if b is None else tuple(_extra(i) for i in b) for b in (extra or [])),
        group_idx=wire.group_idx or 0,
        cache_salt=wire.cache_salt,
    )
    return wire, decoded


@st.composite
def removed(draw: st.DrawFn) -> tuple[enc.Event, Event]:
    hashes = draw(st.lists(wire_hashes, max_size=4))
    wire = enc.BlockRemoved(block_hashes=hashes, medium=draw(media), group_idx=draw(groups))
    decoded = BlockRemoved(
        tuple(_hash_value(h) for h in hashes), normalize_medium(wire.medium), wire.group_idx or 0
    )
    return wire, decoded


events = st.one_of(stored(), removed(), st.just((enc.AllBlocksCleared(), AllBlocksCleared())))


@st.composite
def batches(draw: st.DrawFn) -> tuple[bytes, EventBatch]:
    pairs: list[tuple[Any, Event]] = draw(st.lists(events, max_size=5))
    ts = draw(st.floats(allow_nan=False))
    dp_rank = draw(st.none() | st.integers(-(1 << 63), (1 << 63) - 1))
    positional = draw(st.booleans())
    payload = enc.encode_batch([w for w, _ in pairs], ts, dp_rank, positional=positional)
    return payload, EventBatch(ts, tuple(d for _, d in pairs), dp_rank)
