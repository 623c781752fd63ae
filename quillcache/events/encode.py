"""Build KV-event batches byte for byte as vLLM publishes them (`docs/kv-events.md`).

The simulator and the engine simulator publish through this module, so everything
downstream of them (connectors, decoder, index) sees exactly what a real engine sends.

The event classes are `quillcache.events.types`' (the decoders return the same ones).
Two event shapes (SGLang's, release by release: `quillcache.events.sglang`):

* map form (vLLM >= 0.24): ``{"type": name, field: value, ...}``, optional
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
from typing import Any

import msgpack

from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    Event,
    MmKey,
    RawKey,
)

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineHash",
    "Event",
    "MmKey",
    "RawKey",
    "encode_batch",
    "encode_event",
    "frame",
]


def _wire(value: Any) -> Any:
    """Sequences become lists (msgpack writes tuples as arrays too; this keeps it explicit);
    an mm item is vLLM's ``[mm_hash, offset]``, a raw item its own msgpack value."""
    if isinstance(value, MmKey):
        return [value.hash, value.offset]
    if isinstance(value, RawKey):
        return msgpack.unpackb(value.msgpack, raw=False, strict_map_key=False)
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
    names = event.WIRE_FIELDS
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
