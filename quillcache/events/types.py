"""KV events: one tagged class per event, as vLLM makes its wire format its types
(`docs/kv-events.md`).

The encoder (`quillcache.events.encode`) writes these classes byte for byte as the
engines do; the native decoder (`quillcache._native.decode_batch`) and the pure-Python
reference (`quillcache.events.pyref.decode_batch`) both return them, so results compare
with ``==``. Decoded values are normalised, not raw:

* engine hashes are ``int`` in ``0 .. 2**64-1``: uint64 as sent, int64 (SGLang) by its
  two's-complement bits, digests (bytes mode) by their last 8 bytes big-endian -- the
  value vLLM's default int mode would have sent;
* ``medium`` is ``"GPU"`` (also when not sent), ``"CPU"`` (also ``CPU_PINNED``,
  LMCache's ``cpu``), ``"DISK"`` (also ``STORAGE``), or the engine's string unchanged;
* ``group_idx`` is 0 when not sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from quillcache import _native


@dataclass(frozen=True, slots=True)
class MmKey:
    """A multimodal item in a block's extra keys: ``[mm_hash, offset_in_block]``."""

    hash: str
    offset: int


@dataclass(frozen=True, slots=True)
class RawKey:
    """An extra-key item we do not interpret, kept as its exact msgpack bytes."""

    msgpack: bytes


#: One item of a block's extra keys: a LoRA name or cache salt (str), an mm item, or raw.
ExtraKey = str | MmKey | RawKey


#: An engine hash: an int as decoded (and as vLLM's default int mode sends it); the
#: encoder also takes bytes, to write a digest (bytes mode) or SGLang's int64.
EngineHash = int | bytes


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks entered the engine's prefix cache. Fields as vLLM declares them
    (`vllm/distributed/kv_events.py`); `WIRE_FIELDS` is their order on the wire."""

    TAG: ClassVar[str] = "BlockStored"
    REQUIRED: ClassVar[int] = 7  # block_hashes .. lora_name are always written
    WIRE_FIELDS: ClassVar[tuple[str, ...]] = (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
        "cache_salt",
    )

    block_hashes: Sequence[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None = None
    #: None writes nil (decoded: "GPU")
    medium: str | None = "GPU"
    lora_name: str | None = None
    #: One entry per block (None = no extra keys); decoded: () when the engine sent none.
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None
    #: vLLM >= 0.30 writes 0 for the single-group case; None omits the key (older).
    group_idx: int | None = 0
    #: SGLang sends the salt as a field; vLLM puts it in block 0's extra keys.
    cache_salt: str | None = None
    # Written when set, not interpreted by the decoders (vLLM's newer fields).
    kv_cache_spec_kind: Any = None
    kv_cache_spec_sliding_window: int | None = None
    locality: Any = None
    ownership: Any = None
    session_id: str | None = None
    lookahead_token_ids: Sequence[Sequence[int]] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left the engine's prefix cache (vLLM sends one hash per event)."""

    TAG: ClassVar[str] = "BlockRemoved"
    REQUIRED: ClassVar[int] = 2
    WIRE_FIELDS: ClassVar[tuple[str, ...]] = (
        "block_hashes",
        "medium",
        "group_idx",
        "locality",
        "ownership",
    )

    block_hashes: Sequence[EngineHash]
    medium: str | None = "GPU"
    group_idx: int | None = 0
    locality: Any = None
    ownership: Any = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache."""

    TAG: ClassVar[str] = "AllBlocksCleared"
    REQUIRED: ClassVar[int] = 0
    WIRE_FIELDS: ClassVar[tuple[str, ...]] = ()


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: tuple[Event, ...]
    dp_rank: int | None


#: Medium names are bounded as the Rust index bounds them, with the Rust constants
#: (`rust/core/src/events/types.rs`, docs/kv-events.md): a name longer than
#: MAX_MEDIUM_NAME_BYTES, or an unknown one beyond MAX_CUSTOM_MEDIA, goes to OTHER_MEDIUM;
#: KNOWN_MEDIA (vLLM's EXTERNAL, the fold target, LMCache's backend names) and
#: GPU/CPU/DISK are always kept as sent, compared ASCII case-insensitively.
MAX_MEDIUM_NAME_BYTES: int = _native.MAX_MEDIUM_NAME_BYTES
MAX_CUSTOM_MEDIA: int = _native.MAX_CUSTOM_MEDIA
OTHER_MEDIUM: str = _native.OTHER_MEDIUM
KNOWN_MEDIA: tuple[str, ...] = _native.KNOWN_MEDIA
_KNOWN_UPPER = frozenset(["GPU", "CPU", "DISK", *(k.upper() for k in KNOWN_MEDIA)])


def is_known_medium(medium: str) -> bool:
    """GPU/CPU/DISK or one of KNOWN_MEDIA: kept whatever the limits."""
    return medium.isascii() and medium.upper() in _KNOWN_UPPER


def normalize_medium(medium: str | None) -> str:
    """The engines' medium names reduced to GPU / CPU / DISK (others kept as sent)."""
    if medium is None:
        return "GPU"
    # ASCII-only, as the Rust decoder: str.upper() maps some non-ASCII letters to ASCII.
    upper = medium.upper() if medium.isascii() else medium
    if upper == "GPU":
        return "GPU"
    if upper in ("CPU", "CPU_PINNED"):
        return "CPU"
    if upper in ("DISK", "STORAGE"):
        return "DISK"
    return medium
