"""Type stubs for the Rust extension `quillcache._native`.

Every call that does real work releases the GIL.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Self, TypeAlias, final

import numpy as np
import numpy.typing as npt

from quillcache.events.types import EventBatch, ExtraKey
from quillcache.index.types import Match

__all__ = [
    "KNOWN_MEDIA",
    "MAX_CUSTOM_MEDIA",
    "MAX_EVENT_DEPTH",
    "MAX_MEDIUM_NAME_BYTES",
    "OTHER_MEDIUM",
    "CorruptIndexError",
    "CostKernel",
    "DurableIndex",
    "EventDecodeError",
    "HashingError",
    "IndexLockedError",
    "IngestRefusedError",
    "KvIndex",
    "LoadOrder",
    "Namespace",
    "NativeIndex",
    "PendingPrefixes",
    "PersistenceError",
    "QuillCacheError",
    "QuillSettings",
    "Relay",
    "__version__",
    "best_positions",
    "block_key",
    "content_keys",
    "content_keys_batch",
    "decode_batch",
    "dynamo_costs",
    "llmd_scores",
    "namespace_id",
    "sglang_pick",
    "stored_identity",
    "vllm_block_hashes",
    "vllm_event_hashes",
    "vllm_none_hash",
]

__version__: str

class QuillCacheError(Exception): ...

class EventDecodeError(QuillCacheError):
    """What could not be decoded and where. The native decoder sets `offset` (the byte
    where it went wrong); `apply_many` also `item_index` and `payload_index`, and the
    index classes `stats` (what was applied before it)."""

    offset: int
    item_index: int
    payload_index: int
    stats: Any

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

@final
class Namespace:
    """Identity scope of a key chain (docs/content-key.md); frozen, hashable."""

    def __new__(
        cls,
        model: str = ...,
        tokenizer: str = ...,
        lora: str = ...,
        tenant: str = ...,
        block_size: int = 16,
        extra: Sequence[str] = ...,
    ) -> Self:
        """The strings default to "", `extra` to none."""
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
    model: str = ...,
    tokenizer: str = ...,
    lora: str = ...,
    tenant: str = ...,
    block_size: int = 16,
    extra: Sequence[str] = ...,
) -> int:
    """`Namespace(...).id` (the strings default to "", `extra` to none)."""

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

def vllm_none_hash(seed: str = ...) -> bytes:
    """vLLM's NONE_HASH for sha256_cbor: SHA-256 of CBOR(seed). Pass the engine's
    PYTHONHASHSEED value as `seed` when it sets one."""

def vllm_block_hashes(
    tokens: _Tokens,
    block_size: int,
    *,
    seed: str = ...,
    extra_keys: _VllmExtraKeys | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Full 32-byte sha256_cbor digests of every full block, exactly as vLLM computes
    them; chained from `parent` (a full digest) or from vllm_none_hash(seed)."""

def vllm_event_hashes(
    tokens: _Tokens,
    block_size: int,
    *,
    seed: str = ...,
    extra_keys: _VllmExtraKeys | None = None,
    parent: bytes | None = None,
) -> npt.NDArray[np.uint64]:
    """The values vLLM's KV events carry for those blocks: each digest's last 8 bytes,
    big-endian."""

#: Deepest msgpack container nesting decode_batch accepts (the batch array is depth 1).
MAX_EVENT_DEPTH: int

#: The medium-name bounds of the index (rust/core/src/events/types.rs).
MAX_MEDIUM_NAME_BYTES: int
MAX_CUSTOM_MEDIA: int
OTHER_MEDIUM: str
KNOWN_MEDIA: tuple[str, ...]

def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one KV-event batch (every shape in docs/kv-events.md) with the GIL
    released. Raises EventDecodeError saying what and where; its `offset` attribute is
    the byte offset of the offending value."""

def stored_identity(
    cache_salt: str | None,
    lora_name: str | None,
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None,
) -> tuple[str, str, list[list[tuple[str, int]] | None]]:
    """``(lora, tenant, mm)`` of a BlockStored, by the indexes' own rule (docs/index.md):
    the LoRA is `lora_name` or ""; the tenant `cache_salt`, else the first str in block
    0's extra keys that is not `lora_name`, else ""; `mm[i]` block i's multimodal items
    as (mm_hash, offset_in_block), None when it has none."""

# --- index (rust/python/src/index.rs) ---

#: (worker, dp_rank, medium, refcount): one Residency.
_HolderTuple: TypeAlias = tuple[int, int, str, int]
#: (key, parent, depth, holders, pinned): one Entry.
_EntryTuple: TypeAlias = tuple[int, int, int, list[_HolderTuple], bool]
#: (batches, events, blocks_stored, blocks_removed, clears, orphan_blocks,
#:  unknown_removals, invalid_events): the fields of quillcache.index.ApplyStats.
_ApplyTuple: TypeAlias = tuple[int, int, int, int, int, int, int, int]
_Keys: TypeAlias = npt.NDArray[np.uint64]
_MatchColumns: TypeAlias = tuple[
    npt.NDArray[np.uint64],
    npt.NDArray[np.uint32],
    npt.NDArray[np.uint16],
    npt.NDArray[np.uint32],
    list[str],
]
#: `match_tiers`: the flat tiers, the columns of the hits above the floors, and the
#: floors as (medium code, blocks).
_MatchTiers: TypeAlias = tuple[
    npt.NDArray[np.int64], _MatchColumns, list[tuple[int, int]], list[int]
]

@final
class NativeIndex:
    """The Rust residency index (docs/index.md). Thread-safe: an internal RwLock, taken
    with the GIL released (match shares it, everything else is exclusive). Worker ids
    are u64, dp ranks u32 (OverflowError otherwise); keys must be contiguous 1-D uint64
    arrays (QuillCacheError otherwise). `quillcache.index.native.NativeIndex` wraps this
    class into the IndexBackend protocol with validated input and dataclass results."""

    def __new__(cls) -> Self: ...
    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None:
        """Model and tokenizer of a source: the base of its events' namespace."""
    def apply(self, worker: int, payloads: Sequence[bytes], dp_rank: int = 0) -> _ApplyTuple:
        """Decode and apply raw msgpack event batches in order, GIL released for the
        whole list. A batch's own dp_rank wins over the argument. On a batch that does
        not decode, raises EventDecodeError("payload i of n from worker w: ...") with
        attributes `payload_index` (int) and `stats` (_ApplyTuple of the batches
        applied before it, which stay applied)."""
    def apply_many(
        self, items: Sequence[tuple[int, Sequence[bytes]]], dp_rank: int = 0
    ) -> _ApplyTuple:
        """`apply` for each (worker, payloads) item in order; one GIL release for the
        whole list (a large one decoded on a second thread), the write lock taken per
        window of ~8,192 blocks. On a batch that does not decode,
        raises EventDecodeError with `item_index`, `payload_index` and `stats` (an
        _ApplyTuple of everything applied before it, which stays applied)."""
    def match(self, keys: _Keys) -> list[Match]:
        """Longest run from block 0 of `keys` that each (source, medium) holds (>= 1),
        sorted by (worker, dp_rank, medium). The `Match` objects are shared (cached)."""
    def match_columns(self, keys: _Keys) -> _MatchColumns:
        """`match` as arrays in its order: (worker, dp_rank, medium, blocks, other
        media); a medium is 0 GPU, 1 CPU, 2 DISK or 3 + i for other_media[i]."""
    def match_tiers(
        self,
        keys: _Keys,
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,
    ) -> _MatchTiers:
        """Per candidate (rank 0 at `position[worker]`, negative or past the end: none;
        rank r at `position[worker] + r` when `rank_counts[position]` > r), its
        longest prefix per tier, flat: gpu, cpu, disk x candidates; and the match
        compacted: the columns of the hits above their medium's floor, and the floors
        ((medium code, blocks): every live source holds that many leading blocks), and
        each hit's candidate position (-1: not a candidate).
        `all_live`: every position below `candidates` is a live source (the caller
        vouches), so the floors go to every position without a walk over the sources."""
    def match_many(self, requests: list[_Keys]) -> list[list[Match]]:
        """`match` for each request; one GIL release for the whole list."""
    def remove_worker(self, worker: int) -> int:
        """Forget every dp rank of the worker; returns the resident pairs dropped."""
    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        """AllBlocksCleared for one source (registration kept); returns pairs dropped."""
    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int:
        """Every residency of one source in `medium` dropped (a tier cleared without
        events), with the engine-map entries of the blocks it then holds in no medium;
        returns pairs dropped."""
    def scan(self, prefix: _Keys) -> list[_EntryTuple]:
        """Blocks with a holder or pin under the block named by prefix[-1] (itself
        included), sorted by key; all of them for an empty prefix."""
    def entries(self) -> list[_EntryTuple]:
        """Every block with a holder or a pin, in no particular order."""
    def pin(self, keys: _Keys) -> None:
        """One pin on every block of the path (unknown blocks are created)."""
    def unpin(self, keys: _Keys) -> None:
        """One pin less on every pinned block of the path (no-op for unpinned ones)."""
    def reserve(self, blocks: int) -> None:
        """Pre-size for `blocks` blocks in all (a capacity hint: ingest up to that size
        never re-places the tables). ValueError above 2**26 blocks, MemoryError if the
        memory is not there; the index still grows beyond the hint."""
    def stats(self) -> tuple[int, int, int, int, int, int, int, int]:
        """(blocks, nodes, resident_pairs, sources, pinned, spilled, memory_bytes,
        media_folded); memory_bytes is the exact heap usage of the Rust structures (by
        capacity); media_folded counts stored events whose medium name was beyond the
        limits and went to the OTHER medium."""
    def snapshot(self) -> bytes:
        """The complete state: versioned (magic QCIDXSNP), CRC-32 checksummed."""
    @staticmethod
    def from_snapshot(data: bytes) -> NativeIndex:
        """Restore from `snapshot()` bytes; corrupt, truncated or unknown-version data
        raises QuillCacheError."""
    def state_eq(self, other: NativeIndex) -> bool:
        """Same logical state (blocks, holders, refcounts, pins, sources, engine maps)."""
    def check_invariants(self) -> None:
        """Recount every counter and link; raises QuillCacheError if anything is off."""

# --- persistence (rust/python/src/durable.rs, kv_index.rs) ---

class PersistenceError(QuillCacheError):
    """The durable index could not read or write its directory (the message names the file)."""

class CorruptIndexError(PersistenceError):
    """The write-ahead log or a snapshot is damaged in a way that is not a torn tail."""

class IngestRefusedError(PersistenceError):
    """A write failed earlier (e.g. disk full): the index keeps its logged state and refuses
    changes."""

class IndexLockedError(PersistenceError):
    """Another process holds the index directory."""

@final
class DurableIndex:
    """The native index + write-ahead log + snapshots (see docs/persistence.md).

    Same methods and tuple shapes as `NativeIndex`, plus the persistence ones.
    """

    def __new__(
        cls,
        path: str,
        *,
        durability: str = "interval:10",
        segment_bytes: int = ...,  # 64 MiB
        snapshot_every_bytes: int = ...,  # 4 MiB
        snapshot_log_ratio: float = 0.125,
        snapshot_every_ms: int = 60000,
        snapshot_in_background: bool = True,
        snapshot_on_close: bool = True,
    ) -> Self: ...
    @property
    def path(self) -> str: ...
    @property
    def durability(self) -> str:
        """``none``, ``per-batch`` or ``interval:<ms>``."""
    @property
    def closed(self) -> bool: ...
    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None: ...
    def apply(
        self,
        worker: int,
        payloads: list[bytes],
        dp_rank: int = 0,
        seqs: list[int] | None = None,
    ) -> tuple[int, int, int, int, int, int, int, int]:
        """Decode, log (one write) and apply; `seqs`: the engine's seq of each batch."""
    def match(self, keys: npt.NDArray[np.uint64]) -> list[Match]: ...
    def match_columns(self, keys: npt.NDArray[np.uint64]) -> _MatchColumns: ...
    def match_tiers(
        self,
        keys: npt.NDArray[np.uint64],
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,
    ) -> _MatchTiers: ...
    def match_many(self, requests: list[npt.NDArray[np.uint64]]) -> list[list[Match]]: ...
    def remove_worker(self, worker: int) -> int: ...
    def clear_source(self, worker: int, dp_rank: int = 0) -> int: ...
    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int: ...
    def scan(
        self, prefix: npt.NDArray[np.uint64]
    ) -> list[tuple[int, int, int, list[tuple[int, int, str, int]], bool]]: ...
    def entries(self) -> list[tuple[int, int, int, list[tuple[int, int, str, int]], bool]]: ...
    def pin(self, keys: npt.NDArray[np.uint64]) -> None: ...
    def unpin(self, keys: npt.NDArray[np.uint64]) -> None: ...
    def stats(self) -> tuple[int, int, int, int, int, int, int, int]: ...
    def last_seqs(self) -> dict[tuple[int, int], int]:
        """`{(worker, dp_rank): seq}`: the last engine seq applied per source."""
    def snapshot(self) -> int:
        """Write a snapshot now, prune the log it covers; returns the lsn covered."""
    def sync(self) -> int:
        """fsync the log now; returns the lsn now durable."""
    def index_image(self) -> bytes:
        """The in-memory index image (`NativeIndex.from_snapshot` reads it)."""
    def recovery(self) -> dict[str, object]:
        """What opening did: snapshot lsn/bytes/load time, records replayed, torn tail."""
    def wal_status(self) -> dict[str, object]:
        """`last_lsn`, `synced_lsn`, `snapshot_lsn`, `disk_bytes`, `failure`, `snapshot_error`."""
    def close(self) -> None:
        """Snapshot (unless disabled), fsync, release the directory. Idempotent."""

@final
class KvIndex:
    """The index kept in a key-value store: ``memory``, ``rocksdb`` or ``holt`` (the
    last two need their cargo feature). Same methods as `NativeIndex`."""

    def __new__(cls, store: str, path: str | None = None, *, sync: bool = False) -> Self: ...
    @property
    def store(self) -> str: ...
    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None: ...
    def apply(
        self, worker: int, payloads: list[bytes], dp_rank: int = 0
    ) -> tuple[int, int, int, int, int, int, int, int]: ...
    def match(self, keys: npt.NDArray[np.uint64]) -> list[Match]: ...
    def match_columns(self, keys: npt.NDArray[np.uint64]) -> _MatchColumns: ...
    def match_tiers(
        self,
        keys: npt.NDArray[np.uint64],
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,
    ) -> _MatchTiers: ...
    def match_many(self, requests: list[npt.NDArray[np.uint64]]) -> list[list[Match]]: ...
    def remove_worker(self, worker: int) -> int: ...
    def clear_source(self, worker: int, dp_rank: int = 0) -> int: ...
    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int: ...
    def scan(
        self, prefix: npt.NDArray[np.uint64]
    ) -> list[tuple[int, int, int, list[tuple[int, int, str, int]], bool]]: ...
    def entries(self) -> list[tuple[int, int, int, list[tuple[int, int, str, int]], bool]]: ...
    def pin(self, keys: npt.NDArray[np.uint64]) -> None: ...
    def unpin(self, keys: npt.NDArray[np.uint64]) -> None: ...
    def stats(self) -> tuple[int, int, int, int, int, int, int, int]: ...
    def disk_bytes(self) -> int: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...

_RelayEvent = (
    tuple[Literal["request"], int, str, list[tuple[str, bytes]], bytes, float, str]
    | tuple[Literal["upstream_failed"], int, bool, str, bool]
    | tuple[Literal["first_byte"], int, float]
    | tuple[Literal["usage"], int, bytes]
    | tuple[
        Literal["end"],
        int,
        int,
        bool,
        Literal["complete", "upstream_failed", "client_left"],
        str,
        float,
    ]
)

@final
class Relay:
    """The gateway's data path (``rust/relay``): an HTTP/1.1 server on its own thread.
    POSTs to ``hot_paths`` become ``("request", id, path, headers, body, waited_s,
    peer_ip)`` events, answered with `forward`, `respond` or `delegate`; every other
    request is proxied to ``127.0.0.1:backend_port`` with the client's address in
    ``x-quillcache-peer`` and ``backend_key`` in ``x-quillcache-relay-key`` (a client's
    own headers of those names are dropped). Watch `fileno` and call `take`.

    Events: ``("upstream_failed", id, connect, message, timed_out)`` (reply again;
    ``timed_out``: no answer head, or no first frame of a stream, within the forward's
    ``first_byte_timeout_s``; the client got nothing yet),
    ``("first_byte", id, elapsed_s)``, ``("usage", id, chunk)`` (a chunk mentioning
    ``cached_tokens``), ``("end", id, status, streamed, outcome, detail, elapsed_s)``
    (once per forwarded request)."""

    def __new__(
        cls,
        host: str,
        port: int,
        backend_port: int,
        hot_paths: list[str],
        *,
        max_body_bytes: int,
        connect_timeout_s: float,
        request_timeout_s: float,
        stall_timeout_s: float,
        backend_key: str,
    ) -> Self:
        """Binds ``host:port`` (an IP address; port 0 = any) and starts serving. Once an
        answer started, an engine silent for ``stall_timeout_s`` ends it (an SSE error
        event for a stream, a 502 for a whole answer).
        Raises OSError when it cannot bind."""
    @property
    def port(self) -> int: ...
    def fileno(self) -> int: ...
    def take(self) -> list[_RelayEvent]: ...
    def forward(
        self,
        id: int,
        url: str,
        headers: list[tuple[str, bytes]],
        body: bytes,
        response_headers: list[tuple[str, bytes]],
        first_byte_timeout_s: float,
    ) -> bool:
        """Send ``body`` to ``url`` (``http://``) and relay the answer. False when nobody
        waits for ``id`` any more (its client left). No answer head (for a stream: no
        first frame) within ``first_byte_timeout_s`` is an ``upstream_failed`` event with
        ``timed_out``."""
    def respond(
        self, id: int, status: int, headers: list[tuple[str, bytes]], body: bytes
    ) -> bool: ...
    def delegate(self, id: int) -> bool:
        """Let the backend app serve the request as it came."""
    def stop(self) -> None:
        """Stop accepting and close every connection (waits for the relay's thread)."""

@final
class CostKernel:
    """The cost-model routers' per-row estimates in one pass (bit-identical to the numpy
    reference in `quillcache.costmodel` and `quillcache.routing`)."""

    def __new__(
        cls,
        *,
        linear_flops_per_token: float,
        attn_flops_per_pair: float,
        flops_per_s: float,
        overhead_s: float,
        weight_read_s: float,
        kv_read_s_per_token: float,
        chunk_budget: int,
        block_size: int,
        kv_bytes_per_token: int,
        transfer_latency_s: float,
        cpu_gbps: float,
        disk_gbps: float,
        peer_gbps: float,
        allow_peer_fetch: bool,
        max_num_seqs: int,
    ) -> Self: ...
    def cost_preferences(
        self,
        scores: npt.NDArray[np.float64],
        scores_if_held: npt.NDArray[np.float64] | None,
        gpu: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        position: int,
        size: int,
        prompt_tokens: int,
        blocks: int,
        block_size: int,
    ) -> tuple[list[int], list[float], list[float]] | None:
        """`quillcache.routing.shortlist.cost_preferences` as (positions, requests,
        pending requests); None when a score is NaN. ValueError for columns of
        different lengths or a position outside them."""
    def load_units(
        self,
        worker: npt.NDArray[np.uint64],
        rank: npt.NDArray[np.int64],
        load: npt.NDArray[np.float64],
        gpu: npt.NDArray[np.int64],
        cpu: npt.NDArray[np.int64],
        disk: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        positions: list[int],
        requests: list[float],
        pending_requests: list[float],
        weights: tuple[float, float, float],
        prompt_tokens: int,
        blocks: int,
        block_size: int,
    ) -> tuple[
        list[int], list[int], list[float], list[float], list[int], tuple[float, float] | None
    ]:
        """`quillcache.state.shortlist.shortlist_of` as (workers, ranks, ceilings,
        credits, held blocks, outside (ceiling, credit) or None for no rows)."""
    def load_sums(self, load: npt.NDArray[np.float64]) -> tuple[float, float]:
        """(running decodes, requests waiting) summed over the rows in order."""
    def ttft(
        self,
        worker: npt.NDArray[np.uint64],
        load: npt.NDArray[np.float64],
        gpu: npt.NDArray[np.int64],
        cpu: npt.NDArray[np.int64],
        disk: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        blocks: int,
        prompt_tokens: int,
        block_size: int,
    ) -> tuple[int, npt.NDArray[np.float64]]:
        """(position, estimates): estimated TTFT per row and the row that wins."""
    def ttft_lowest(
        self,
        order: LoadOrder,
        position: npt.NDArray[np.intp],
        special: npt.NDArray[np.intp],
        worker: npt.NDArray[np.uint64],
        load: npt.NDArray[np.float64],
        gpu: npt.NDArray[np.int64],
        cpu: npt.NDArray[np.int64],
        disk: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        blocks: int,
        prompt_tokens: int,
        block_size: int,
    ) -> int | None:
        """`ttft`'s position, walking `special` then the rest in `order` (by queued
        prefill tokens; `position[row]` < 0: not a candidate) until no row left can
        win; None: peer fetch or a NaN estimate (score every row)."""
    def quill(
        self,
        worker: npt.NDArray[np.uint64],
        load: npt.NDArray[np.float64],
        gpu: npt.NDArray[np.int64],
        cpu: npt.NDArray[np.int64],
        disk: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        blocks: int,
        prompt_tokens: int,
        block_size: int,
        settings: QuillSettings,
        lambda_: float,
        continuing: bool,
        mean_decodes: float,
        expected_output_tokens: int,
        session_kv_tokens: npt.NDArray[np.float64] | None,
        pace: npt.NDArray[np.float64] | None,
        slots: npt.NDArray[np.float64] | None = None,
        fleet: npt.NDArray[np.float64] | None = None,
    ) -> tuple[int, npt.NDArray[np.float64]]:
        """(position, estimates): QuillCache's score per row and the row that wins.
        `slots`: per row, its engine's sequence slots (0: the cost model's
        `max_num_seqs`; a ValueError for anything else below 1). `fleet`: the view's
        fleet columns (`WorkerColumns.fleet`, C-contiguous), for the eviction term."""
    def quill_lowest(
        self,
        order: LoadOrder,
        position: npt.NDArray[np.intp],
        special: npt.NDArray[np.intp],
        worker: npt.NDArray[np.uint64],
        load: npt.NDArray[np.float64],
        gpu: npt.NDArray[np.int64],
        cpu: npt.NDArray[np.int64],
        disk: npt.NDArray[np.int64],
        pending: npt.NDArray[np.int64],
        blocks: int,
        prompt_tokens: int,
        block_size: int,
        settings: QuillSettings,
        lambda_: float,
        continuing: bool,
        mean_decodes: float,
        expected_output_tokens: int,
        session_kv_tokens: npt.NDArray[np.float64] | None,
        pace: npt.NDArray[np.float64] | None,
        slots: npt.NDArray[np.float64] | None = None,
        fleet: npt.NDArray[np.float64] | None = None,
    ) -> int | None:
        """`quill`'s position, walking `special` then the rest in `order` (by queued
        prefill tokens; `position[row]` < 0: not a candidate) until no row left can
        win; None: the knobs or a NaN score do not allow it (score every row)."""

@final
class QuillSettings:
    """`QuillCacheRouter`'s knobs, fixed when the router is made (`CostKernel.quill`)."""

    def __new__(
        cls,
        *,
        speculative: bool,
        interference: bool,
        work_weight: float,
        per_worker_lambda: bool,
        work_base: float,
        max_work_weight: float,
        continuing_work_weight: float,
        decode_weight: float,
        home_decode_weight: float,
        evict_weight: float = 0.0,
    ) -> Self: ...

@final
class PendingPrefixes:
    """Speculative residency: content key -> the workers computing it right now."""

    def __init__(self) -> None: ...
    def add(self, worker: int, keys: _Keys) -> None:
        """One more request computing `keys` on `worker`."""
    def remove(self, worker: int, keys: _Keys) -> None:
        """One request fewer computing `keys` on `worker` (keys never added: ignored)."""
    def remove_worker(self, worker: int) -> None: ...
    def prefixes(self, keys: _Keys) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint32]]:
        """(workers, blocks): how many of `keys` from the first each worker is computing."""
    def __len__(self) -> int: ...

@final
class LoadOrder:
    """A fleet's rows in order of some load values, then worker id, then rank
    (`f64::total_cmp`, -0.0 as 0.0): the control plane's ordered load structure."""

    def __new__(cls, width: int) -> Self:
        """`width` values (1-4) per row; ValueError otherwise."""
    @property
    def width(self) -> int: ...
    def __len__(self) -> int: ...
    def set(self, row: int, values: Sequence[float], worker: int, rank: int) -> None:
        """Place (or move) `row`; ValueError when `values` is not `width` long."""
    def set_many(
        self,
        rows: npt.NDArray[np.int64],
        values: npt.NDArray[np.float64],
        workers: npt.NDArray[np.uint64],
        ranks: npt.NDArray[np.uint32],
    ) -> None:
        """`set` for each row (`values`: rows x width)."""
    def remove(self, row: int) -> bool:
        """Forget `row`; False when it was not placed."""
    def values(self, row: int) -> list[float] | None:
        """The values `row` is placed by."""
    def rows(self) -> npt.NDArray[np.int64]:
        """Every row, from the least loaded."""
    def first(self, k: int, position: npt.NDArray[np.intp]) -> npt.NDArray[np.intp]:
        """`position[row]` of the first `k` rows in order with a position >= 0."""

def dynamo_costs(
    load: npt.NDArray[np.float64],
    capacity: npt.NDArray[np.float64],
    gpu: npt.NDArray[np.int64],
    cpu: npt.NDArray[np.int64],
    disk: npt.NDArray[np.int64],
    pending: npt.NDArray[np.int64],
    full_blocks: int,
    prompt_tokens: int,
    block_size: int,
    *,
    overlap_score_credit: float,
    host_cache_hit_weight: float,
    disk_cache_hit_weight: float,
    prefill_load_scale: float,
    overlap_score_credit_decay: float,
    active_request_weight: float,
) -> npt.NDArray[np.float64]:
    """`DynamoKvCost.logits` per row (lower is better), bit for bit."""

def llmd_scores(
    load: npt.NDArray[np.float64],
    capacity: npt.NDArray[np.float64],
    gpu: npt.NDArray[np.int64],
    cpu: npt.NDArray[np.int64],
    disk: npt.NDArray[np.int64],
    pending: npt.NDArray[np.int64],
    *,
    prefix_weight: float,
    queue_weight: float,
    kv_weight: float,
    gpu_tier_weight: float,
    cpu_tier_weight: float,
) -> npt.NDArray[np.float64]:
    """llm-d's weighted score per row (higher is better), bit for bit."""

def best_positions(
    values: npt.NDArray[np.float64], tolerance: float = 0.0, lowest: bool = True
) -> list[int]:
    """The positions (ascending) within `tolerance` of the lowest value (`lowest`) or of
    the highest: numpy's `flatnonzero(v <= v.min() + tol)` / `flatnonzero(v >= v.max()
    - tol)`, in one pass. ValueError for an empty array or a NaN."""

def sglang_pick(
    load: npt.NDArray[np.float64],
    fleet: npt.NDArray[np.float64],
    worker: npt.NDArray[np.uint64],
    gpu: npt.NDArray[np.int64],
    pending: npt.NDArray[np.int64],
    abs_threshold: float,
    rel_threshold: float,
) -> tuple[int, int, int]:
    """SGLang cache-aware's candidate positions `(least, longest, smallest)` in one pass:
    the shortest queue (then lowest id) when the load is imbalanced (`max - min >
    abs_threshold` and `max > min * rel_threshold`, requests in flight), else -1; the
    longest match (GPU or pending), then shortest queue, then lowest id; the fewest
    resident blocks (`fleet[:, 1]`), then shortest queue, then lowest id. ValueError for
    a NaN in flight or resident count."""
