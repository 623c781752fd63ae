"""Decoded KV events, as both decoders return them (`docs/kv-events.md`).

The native decoder (`quillcache._native.decode_batch`) and the pure-Python reference
(`quillcache.events.pyref.decode_batch`) both build these classes, so results compare
with ``==``. Values are normalised, not raw:

* engine hashes are ``int`` in ``0 .. 2**64-1``: uint64 as sent, int64 (SGLang) by its
  two's-complement bits, digests (bytes mode) by their last 8 bytes big-endian -- the
  value vLLM's default int mode would have sent;
* ``medium`` is ``"GPU"`` (also when not sent), ``"CPU"`` (also ``CPU_PINNED``,
  LMCache's ``cpu``), ``"DISK"`` (also ``STORAGE``), or the engine's string unchanged;
* ``group_idx`` is 0 when not sent.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str
    lora_name: str | None
    #: One entry per block (None = no extra keys); empty when the engine sent none.
    extra_keys: tuple[tuple[ExtraKey, ...] | None, ...]
    group_idx: int
    #: SGLang sends the salt as a field; vLLM puts it in block 0's extra keys.
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str
    group_idx: int


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


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
