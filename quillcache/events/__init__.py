"""KV-cache events: decoding (native), a pure-Python reference decoder, and an encoder
that writes vLLM's exact wire format (`docs/kv-events.md`).

    from quillcache.events import decode_batch          # Rust, GIL released
    from quillcache.events.pyref import decode_batch    # pure-Python oracle
    from quillcache.events.encode import encode_batch, frame, BlockStored, ...
"""

from __future__ import annotations

from quillcache._native import MAX_EVENT_DEPTH, decode_batch
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    ExtraKey,
    MmKey,
    RawKey,
)

__all__ = [
    "MAX_EVENT_DEPTH",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "Event",
    "EventBatch",
    "ExtraKey",
    "MmKey",
    "RawKey",
    "decode_batch",
]
