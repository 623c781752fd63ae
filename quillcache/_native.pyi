"""Type stubs for the Rust extension `quillcache._native`.

Every call that does real work releases the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from quillcache.events.types import EventBatch

__version__: str

class QuillCacheError(Exception): ...
class EventDecodeError(QuillCacheError): ...
class HashingError(QuillCacheError): ...

# --- hashing and events (rust/python/src/hashing.rs, events.rs) ---

#: Token ids: a 1-D numpy array of uint32 (read in place) or int64 (range-checked,
#: HashingError names the first index outside 0..2**32-1), or a list of ints.
_Tokens: TypeAlias = npt.NDArray[np.uint32] | npt.NDArray[np.int64] | Sequence[int]
#: Per block: None, or that block's multimodal items as (mm_hash, offset_in_block).
_MmPerBlock: TypeAlias = Sequence[Sequence[tuple[str, int]] | None]
#: Per block: None, or vLLM extra keys, a tuple of tuples of str / int / bytes,
#: e.g. (("lora", name, path), ("mm", mm_hash, offset), ("cache_salt", salt)).
_VllmExtraKeys: TypeAlias = Sequence[Sequence[Sequence[str | int | bytes]] | None]

class Namespace:
    """Identity scope of a key chain (docs/content-key.md); frozen, hashable."""

    def __init__(
        self,
        model: str = "",
        tokenizer: str = "",
        lora: str = "",
        tenant: str = "",
        block_size: int = 16,
        extra: Sequence[str] = (),
    ) -> None: ...
    @property
    def model(self) -> str: ...
    @property
    def tokenizer(self) -> str: ...
    @property
    def lora(self) -> str: ...
    @property
    def tenant(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def extra(self) -> list[str]: ...
    @property
    def id(self) -> int:
        """The stable 64-bit namespace id, root of every key chain in this namespace."""
    def canonical_bytes(self) -> bytes:
        """The exact bytes that `id` hashes with xxh3-64."""
    def content_keys(self, tokens: _Tokens) -> npt.NDArray[np.uint64]:
        """`content_keys(tokens, self.block_size, self.id)`."""

def namespace_id(
    model: str = "",
    tokenizer: str = "",
    lora: str = "",
    tenant: str = "",
    block_size: int = 16,
    extra: Sequence[str] = (),
) -> int:
    """`Namespace(...).id`."""

def content_keys(
    tokens: _Tokens, block_size: int, parent: int, *, mm: _MmPerBlock | None = None
) -> npt.NDArray[np.uint64]:
    """Chained content keys of every full block (a partial tail gets none), from `parent`
    (a namespace id, or the key of the block before `tokens`). GIL released."""

def content_keys_batch(
    tokens: _Tokens,
    offsets: npt.NDArray[np.int64],
    block_size: int,
    parents: int | npt.NDArray[np.uint64],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.int64]]:
    """Keys of many sequences in one call. Sequence j is tokens[offsets[j]:offsets[j+1]]
    chained from parents (one int for all, or one per sequence). Returns (keys,
    key_offsets): sequence j's keys are keys[key_offsets[j]:key_offsets[j+1]]."""

def block_key(parent: int, tokens: _Tokens, mm: Sequence[tuple[str, int]] | None = None) -> int:
    """The key of one block chained onto `parent` (an empty mm list = no items)."""

def vllm_none_hash(seed: str = "vllm-none-hash") -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: SHA-256 of CBOR(seed). Pass the engine's
    PYTHONHASHSEED value as `seed` when it sets one."""

def vllm_block_hashes(
    tokens: _Tokens,
    block_size: int,
    *,
    seed: str = "vllm-none-hash",
    extra_keys: _VllmExtraKeys | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Full 32-byte sha256_cbor digests of every full block, exactly as vLLM computes
    them; chained from `parent` (a full digest) or from vllm_none_hash(seed)."""

def vllm_event_hashes(
    tokens: _Tokens,
    block_size: int,
    *,
    seed: str = "vllm-none-hash",
    extra_keys: _VllmExtraKeys | None = None,
    parent: bytes | None = None,
) -> npt.NDArray[np.uint64]:
    """The values vLLM's KV events carry for those blocks: each digest's last 8 bytes,
    big-endian."""

#: Deepest msgpack container nesting decode_batch accepts (the batch array is depth 1).
MAX_EVENT_DEPTH: int

def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one KV-event batch (every shape in docs/kv-events.md) with the GIL
    released. Raises EventDecodeError saying what and where; its `offset` attribute is
    the byte offset of the offending value."""

# --- index (rust/python/src/index.rs) ---

# --- persistence (rust/python/src/persist.rs) ---
