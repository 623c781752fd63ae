"""The `IndexBackend` protocol: what every residency index implements.

Every call is batch-shaped (many event batches per `apply`, one request per
`match`), so that a remote backend (Redis, a sidecar) costs one round trip where a
local one costs a function call. Semantics are specified in `docs/index.md`; the
conformance suite `tests/index/` runs against every registered backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from quillcache.index.types import ApplyStats, Entry, IndexStats, Match, MatchColumns, SourceId

KeyArray = npt.NDArray[np.uint64]


@runtime_checkable
class IndexBackend(Protocol):
    """Residency of KV blocks across engines, keyed by QuillCache content keys."""

    name: str
    #: True when the backend serialises concurrent readers and writers itself (one
    #: thread may apply while another matches); else the caller serialises.
    thread_safe: bool

    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None:
        """Declare the model/tokenizer a source serves: the base of its events' namespace.

        A source that was never registered has model "" and tokenizer "".
        """

    def apply(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        *,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        """Decode and apply raw msgpack event batches from one source, in order.

        `seqs`: the engine's sequence number of each batch, when known. A persistent
        backend records the last one per source (`last_seqs`), so that a restarted
        gateway asks the engine to replay from there; an in-memory one ignores them.

        A batch that fails to decode raises `quillcache.errors.EventDecodeError`; the
        batches before it are applied, it and the ones after are not (the error says
        which index failed), so a caller can resume exactly.
        """
        ...

    def last_seqs(self) -> dict[SourceId, int]:
        """The last engine seq applied per source, as far as this backend keeps it
        across restarts (empty for an in-memory backend)."""
        ...

    def match(self, keys: KeyArray) -> list[Match]:
        """Longest cached prefix of `keys` per (source, medium); sources with 0 omitted."""
        ...

    def match_columns(self, keys: KeyArray) -> MatchColumns:
        """`match` as arrays, in the same order (what the control plane routes on)."""
        ...

    def match_tiers(
        self,
        keys: KeyArray,
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,
    ) -> tuple[npt.NDArray[np.int64], MatchColumns]:
        """A (3, candidates) array: per candidate (a worker's rank 0 is at
        `position[worker]`, negative or past the end: not a candidate; its rank r at
        `position[worker] + r` when `rank_counts[position[worker]]` > r, and without
        `rank_counts` no rank but 0 is a candidate) its longest prefix in the gpu, cpu
        and disk tiers (a medium beyond GPU and CPU is disk); and the match's columns,
        which may be compact (`MatchColumns.floors`: what every live source holds, the
        arrays only the hits above it). Every candidate must be a registered source.
        `all_live`: the caller vouches that every position below `candidates` is one
        (the control plane's candidates are), so a compact backend gives the floors to
        every position without walking its sources; a backend may ignore it."""
        ...

    def remove_worker(self, worker: int) -> int:
        """Drop every source of a worker (all dp ranks); returns resident pairs dropped."""
        ...

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        """AllBlocksCleared for one source; returns resident pairs dropped."""
        ...

    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int:
        """Every residency of one source in `medium` dropped, as if the engine had sent a
        BlockRemoved of that medium for each of those blocks (every reference at once):
        the engine-map entries of the blocks it then holds in no medium go too. For a
        tier cleared without events (LMCache's `/clear`). Returns resident pairs
        dropped."""
        ...

    def scan(self, prefix: KeyArray) -> list[Entry]:
        """Every block in the subtree under the block named by `prefix[-1]` (itself
        included), sorted by key; the whole index for an empty prefix."""
        ...

    def pin(self, keys: KeyArray) -> None:
        """Pin a prefix: its blocks stay in the index (and are reported) even with no holder."""

    def unpin(self, keys: KeyArray) -> None:
        """Undo one `pin` of the same prefix."""

    def stats(self) -> IndexStats: ...

    def entries(self) -> Iterator[Entry]:
        """Every block with its holders, in no particular order."""
        ...

    def close(self) -> None:
        """Release resources (files, handles). Idempotent."""
