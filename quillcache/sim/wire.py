"""Fast encoding of the engine model's KV events, byte-identical to `quillcache.events.encode`.

The simulator publishes hundreds of thousands of BlockStored events carrying up to
tens of thousands of token ids each; building them through the general encoder costs
milliseconds per event. This module writes the same bytes (vLLM >= 0.24 map form,
msgspec header widths) with the token array packed by numpy. `tests/sim/test_wire.py`
checks the equality against `quillcache.events.encode` for random events.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import msgpack
import numpy as np
import numpy.typing as npt

from quillcache.events.encode import BlockRemoved, encode_event

_packer = msgpack.Packer(use_bin_type=True)
_pack = _packer.pack

# BlockStored declares 16 fields + "type" (msgspec sizes the header from that: map16);
# we write type + the 7 required fields + group_idx = 9 entries.
_STORED_HEAD = b"\xde\x00\x09" + _pack("type") + _pack("BlockStored") + _pack("block_hashes")
_K_PARENT = _pack("parent_block_hash")
_K_TOKENS = _pack("token_ids")
_K_BLOCK_SIZE = _pack("block_size")
_K_LORA_ID = _pack("lora_id") + _pack(None)
_K_MEDIUM = _pack("medium")
_STORED_TAIL = _pack("lora_name") + _pack(None) + _pack("group_idx") + _pack(0)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


def pack_tokens(tokens: npt.NDArray[np.uint32]) -> bytes:
    """msgpack array of token ids; vectorised when every id needs a uint16."""
    n = len(tokens)
    if n and int(tokens.min()) >= 256 and int(tokens.max()) < 65536:
        out = np.empty((n, 3), dtype=np.uint8)
        out[:, 0] = 0xCD
        out[:, 1:] = tokens.astype(">u2").view(np.uint8).reshape(n, 2)
        return _array_header(n) + out.tobytes()
    return _pack([int(t) for t in tokens])


def block_stored(
    hashes: Sequence[int] | npt.NDArray[np.uint64],
    parent: int | None,
    tokens: npt.NDArray[np.uint32] | bytes,
    block_size: int,
    medium: str = "GPU",
) -> bytes:
    """One BlockStored event (bytes) as `encode_event(BlockStored(...))` writes it.
    `tokens` may be given already packed (a msgpack array, see `pack_tokens`)."""
    return b"".join(
        (
            _STORED_HEAD,
            _pack(hashes.tolist() if isinstance(hashes, np.ndarray) else list(hashes)),
            _K_PARENT,
            _pack(parent),
            _K_TOKENS,
            tokens if isinstance(tokens, bytes) else pack_tokens(tokens),
            _K_BLOCK_SIZE,
            _pack(block_size),
            _K_LORA_ID,
            _K_MEDIUM,
            _pack(medium),
            _STORED_TAIL,
        )
    )


_removed_cache: dict[str, tuple[bytes, bytes]] = {}


def block_removed(block_hash: int, medium: str = "GPU") -> bytes:
    """One BlockRemoved event for one hash (vLLM sends one per evicted block)."""
    parts = _removed_cache.get(medium)
    if parts is None:
        # Split the general encoder's output around a marker hash, once per medium.
        marker = 0xFFFF_FFFF_FFFF_FFFF
        full = encode_event(BlockRemoved(block_hashes=[marker], medium=medium))
        packed_marker = _pack([marker])
        i = full.index(packed_marker)
        parts = (full[:i], full[i + len(packed_marker) :])
        _removed_cache[medium] = parts
    if block_hash >= 1 << 32:  # uint64: what msgpack writes for every large hash
        return b"".join((parts[0], b"\x91\xcf", block_hash.to_bytes(8, "big"), parts[1]))
    return parts[0] + _pack([block_hash]) + parts[1]


def blocks_removed(block_hashes: npt.NDArray[np.uint64], medium: str = "GPU") -> bytes:
    """`block_removed(h, medium)` for each hash, concatenated: one numpy pass when every
    hash needs a uint64 (all but ~2**-32 of them), else one event at a time."""
    n = len(block_hashes)
    if n == 0:
        return b""
    if int(block_hashes.min()) < 1 << 32:
        return b"".join(block_removed(int(h), medium) for h in block_hashes.tolist())
    block_removed(1 << 32, medium)  # fills the cache
    head, tail = _removed_cache[medium]
    head = head + b"\x91\xcf"
    out = np.empty((n, len(head) + 8 + len(tail)), dtype=np.uint8)
    out[:, : len(head)] = np.frombuffer(head, dtype=np.uint8)
    out[:, len(head) : len(head) + 8] = block_hashes.astype(">u8").view(np.uint8).reshape(n, 8)
    out[:, len(head) + 8 :] = np.frombuffer(tail, dtype=np.uint8)
    return out.tobytes()


def batch(
    ts: float, events: Sequence[bytes], dp_rank: int | None = 0, count: int | None = None
) -> bytes:
    """`[ts, [events...], dp_rank]` from already-encoded events (as `encode_batch`).
    `count`: the number of events when some items hold several (`blocks_removed`)."""
    n = len(events) if count is None else count
    head = (b"\x92" if dp_rank is None else b"\x93") + _pack(float(ts)) + _array_header(n)
    return head + b"".join(events) + (b"" if dp_rank is None else _pack(dp_rank))
