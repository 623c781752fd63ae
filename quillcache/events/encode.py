"""Build KV-event batches byte for byte as vLLM publishes them (`docs/kv-events.md`).

The simulator and the engine simulator publish through this module, so everything
downstream of them (connectors, decoder, index) sees exactly what a real engine sends.

Two event shapes:

* map form (vLLM >= 0.24, SGLang): ``{"type": name, field: value, ...}``, optional
  fields omitted when None, required ones written even when None. vLLM encodes with
  msgspec, which sizes the map header for the struct's *declared* number of keys
  (then writes the actual count), so a BlockStored (16 declared keys) always gets a
  map16 header (``de 00 0a``) even with 10 keys. We reproduce that, or the golden
  frames would not match.
* array form (vLLM <= 0.23): ``[name, field, field, ...]`` in declaration order.
  msgspec writes every declared field; since older releases declared fewer, we
  write the required fields plus the optional ones up to the last that is set.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import msgpack

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHashValue",
    "Event",
    "encode_batch",
    "encode_event",
    "frame",
]

#: An engine hash as it goes on the wire: an int (uint64, or int64 for SGLang) or a digest.
EngineHashValue = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the engine's prefix cache. Field names and order as in vLLM."""

    TAG: ClassVar[str] = "BlockStored"
    REQUIRED: ClassVar[int] = 7  # block_hashes .. lora_name are always written

    block_hashes: Sequence[EngineHashValue]
    parent_block_hash: EngineHashValue | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None
    #: One entry per block: None, or a sequence of str / (mm_hash, offset) items.
    extra_keys: Sequence[Sequence[Any] | None] | None = None
    #: vLLM >= 0.30 writes 0 for the single-group case; None omits the key (older).
    group_idx: int | None = 0
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[int]] | None = None
    #: SGLang only (vLLM carries the salt in block 0's extra keys).
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's prefix cache (vLLM sends one hash per event)."""

    TAG: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[int] = 2

    block_hashes: Sequence[EngineHashValue]
    medium: str | None = "GPU"
    group_idx: int | None = 0
    locality: Any = None
    ownership: Any = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""

    TAG: ClassVar[str] = "AllBlocksCleared"
    REQUIRED: ClassVar[int] = 0


Event = BlockStored | BlockRemoved | AllBlocksCleared


def _wire(value: Any) -> Any:
    """Sequences become lists (msgpack writes tuples as arrays too; this keeps it explicit)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) or not isinstance(value, Sequence):
        return value
    return [_wire(v) for v in value]


def _map_header(declared: int, actual: int) -> bytes:
    # Width chosen from the declared key count, as msgspec does (see module docstring).
    if declared < 16:
        return bytes([0x80 | actual])
    if declared < 1 << 16:
        return b"\xde" + struct.pack(">H", actual)
    return b"\xdf" + struct.pack(">I", actual)


def encode_event(event: Event, *, positional: bool = False) -> bytes:
    """msgpack bytes of one event, map form (default) or array form (vLLM <= 0.23)."""
    names = [f.name for f in fields(event)]
    values = [getattr(event, n) for n in names]
    packer = msgpack.Packer(use_bin_type=True)
    if positional:
        last_set = max((i for i, v in enumerate(values) if v is not None), default=-1)
        count = max(event.REQUIRED, last_set + 1)
        out = [packer.pack_array_header(1 + count), packer.pack(event.TAG)]
        out += [packer.pack(_wire(v)) for v in values[:count]]
        return b"".join(out)
    items = [
        (n, v)
        for i, (n, v) in enumerate(zip(names, values, strict=True))
        if i < event.REQUIRED or v is not None
    ]
    out = [_map_header(len(names) + 1, len(items) + 1), packer.pack("type"), packer.pack(event.TAG)]
    for name, value in items:
        out += [packer.pack(name), packer.pack(_wire(value))]
    return b"".join(out)


def encode_batch(
    events: Sequence[Event],
    ts: float,
    dp_rank: int | None = 0,
    *,
    positional: bool = False,
) -> bytes:
    """One event batch: ``[ts, [events...], dp_rank]``; dp_rank None writes ``[ts, events]``.

    vLLM's EventBatch omits a None rank (msgspec ``omit_defaults`` on an array-like
    struct drops trailing defaults), which is the "very old" two-element shape.
    """
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_array_header(2 if dp_rank is None else 3), packer.pack(float(ts))]
    parts.append(packer.pack_array_header(len(events)))
    parts += [encode_event(e, positional=positional) for e in events]
    if dp_rank is not None:
        parts.append(packer.pack(dp_rank))
    return b"".join(parts)


def frame(topic: bytes, seq: int, payload: bytes) -> list[bytes]:
    """The three ZMQ frames of one message: topic, seq as 8 bytes big-endian, payload."""
    if not 0 <= seq < 1 << 64:
        raise ValueError(f"seq must fit in an unsigned 64-bit integer, got {seq}")
    return [bytes(topic), seq.to_bytes(8, "big"), bytes(payload)]
