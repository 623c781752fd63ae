"""Pure-Python reference of QuillCache's content key (`docs/content-key.md`).

Deliberately simple and slow: it is the oracle that the Rust implementation and the
`MemoryIndex` are checked against, never the hot path.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

SEED = 0x71756C6C636B3031
_NS_TAG = b"quillcache-ns-v1"


def _field(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<I", len(b)) + b


def namespace_id(
    model: str = "",
    tokenizer: str = "",
    lora: str = "",
    tenant: str = "",
    block_size: int = 16,
    extra: Sequence[str] = (),
) -> int:
    data = (
        _NS_TAG
        + b"".join(_field(s) for s in (model, tokenizer, lora, tenant))
        + struct.pack("<I", block_size)
        + struct.pack("<I", len(extra))
        + b"".join(_field(e) for e in extra)
    )
    return xxhash.xxh3_64_intdigest(data, seed=SEED)


def block_key(
    parent: int, tokens: Sequence[int], mm: Sequence[tuple[str, int]] | None = None
) -> int:
    data = struct.pack("<Q", parent) + b"".join(struct.pack("<I", t) for t in tokens)
    if mm:  # an empty list means no items, as in docs/content-key.md
        data += struct.pack("<I", len(mm))
        data += b"".join(_field(h) + struct.pack("<q", off) for h, off in mm)
    return xxhash.xxh3_64_intdigest(data, seed=SEED)


def content_keys(tokens: Sequence[int], block_size: int, parent: int) -> list[int]:
    """Keys of every full block of `tokens`, chained from `parent` (a namespace id)."""
    keys: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_key(parent, tokens[start : start + block_size])
        keys.append(parent)
    return keys
