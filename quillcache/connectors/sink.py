"""Where decoded-and-applied events go: the `IngestSink` interface.

The connector only moves raw msgpack batches; decoding and apply happen behind
`ingest` (in Rust for the native index). `ControlPlane` implements this shape; an
`IndexSink` wraps a bare `IndexBackend` for tools and tests that need no routing.

Both sinks pass each source's batches through a `GroupFolder` first: a source whose
events name KV-cache groups (hybrid models) is applied as one group, a block counting
only where every group holds it (`quillcache.events.groups`, docs/kv-events.md). Then,
knowing the engines' block size, through a `ChunkSplitter`: LMCache's chunks are cut
into the engine blocks they cover, so that requests keyed at that size find them
(`quillcache.events.chunks`). Any other payload reaches the index as it came.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from quillcache.errors import EventDecodeError
from quillcache.events.chunks import ChunkSplitter, SplitStats, split_payloads
from quillcache.events.groups import FoldStats, GroupFolder, fold_payloads
from quillcache.index.protocol import IndexBackend
from quillcache.index.types import ApplyStats

if TYPE_CHECKING:
    from quillcache.controlplane import ControlPlane


@runtime_checkable
class IngestSink(Protocol):
    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        """Decode and apply raw event batches of one source, in order; `seqs`: the
        engine's seq of each batch when known (a persistent index records them).

        A batch that does not decode raises `EventDecodeError` with `payload_index` (which
        one) and `stats` (the `ApplyStats` of the batches before it, which stay applied),
        as every `IndexBackend.apply` does."""
        ...

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        """Forget everything one source holds (restart, unrecoverable gap)."""
        ...

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        """Mark a source's residency as unknown (True) or trusted again (False)."""
        ...


def _apply_folded(
    apply: Callable[[list[bytes], Sequence[int] | None], ApplyStats],
    folded: list[bytes],
    refused: EventDecodeError | None,
    seqs: Sequence[int] | None,
) -> ApplyStats:
    """Apply the folded payloads; then raise the folder's refusal, if any, as the index
    raises a batch that does not decode (`payload_index`, and `stats` of those before)."""
    if refused is None:
        return apply(folded, seqs)
    stats = apply(folded, None if seqs is None else seqs[: len(folded)]) if folded else ApplyStats()
    refused.stats = stats
    raise refused


class IndexSink:
    """An `IngestSink` over one `IndexBackend`, remembering which sources are stale."""

    def __init__(self, index: IndexBackend, block_size: int | None = None) -> None:
        """`block_size`: the engines' (requests are keyed at it); None keeps LMCache's
        chunks as they came."""
        self.index = index
        self.groups = GroupFolder()
        self.chunks = None if block_size is None else ChunkSplitter(block_size)
        self._lock = threading.Lock()
        self.stale: set[tuple[int, int]] = set()

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        folded, refused = fold_payloads(self.groups, worker, payloads, dp_rank)
        split = split_payloads(self.chunks, worker, folded, dp_rank)
        return _apply_folded(
            lambda p, s: self.index.apply(worker, p, dp_rank, seqs=s), split, refused, seqs
        )

    def fold_stats(self) -> FoldStats:
        """The group folder's counters (a copy: the applier thread moves the live ones)."""
        return dataclasses.replace(self.groups.stats)

    def split_stats(self) -> SplitStats:
        """The chunk splitter's counters (a copy; zeros without a splitter)."""
        return SplitStats() if self.chunks is None else dataclasses.replace(self.chunks.stats)

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        self.groups.clear(worker, dp_rank)
        if self.chunks is not None:
            self.chunks.clear(worker, dp_rank)
        return self.index.clear_source(worker, dp_rank)

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        with self._lock:
            if stale:
                self.stale.add((worker, dp_rank))
            else:
                self.stale.discard((worker, dp_rank))


class ControlPlaneSink:
    """An `IngestSink` over a `ControlPlane` (`ingest`, `clear`), remembering stale sources.

    Called from the ingestor's thread while the gateway routes on its event loop: the
    plane serialises its index (`ControlPlane`), and ingest only touches per-worker
    counters of the plane besides the index.
    """

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.groups = GroupFolder()
        self.chunks = ChunkSplitter(plane.block_size)
        self._lock = threading.Lock()
        self.stale: set[tuple[int, int]] = set()

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        # The worker's state object names its registration: a worker removed and added
        # again gets a new one, and the folder drops what it kept for the old.
        owner = self.plane.worker(worker)
        folded, refused = fold_payloads(self.groups, worker, payloads, dp_rank, owner)
        split = split_payloads(self.chunks, worker, folded, dp_rank)
        return _apply_folded(
            lambda p, s: self.plane.ingest(worker, p, dp_rank, seqs=s), split, refused, seqs
        )

    def fold_stats(self) -> FoldStats:
        """The group folder's counters (a copy: the applier thread moves the live ones),
        for /metrics (`gateway.metrics.fold_metrics`)."""
        return dataclasses.replace(self.groups.stats)

    def split_stats(self) -> SplitStats:
        """The chunk splitter's counters (a copy), for /metrics."""
        return dataclasses.replace(self.chunks.stats)

    def last_seqs(self) -> dict[tuple[int, int], int]:
        """(worker, dp_rank) -> last applied seq, as the index keeps it across restarts."""
        return {(s.worker, s.dp_rank): q for s, q in self.plane.index.last_seqs().items()}

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        self.groups.clear(worker, dp_rank)
        self.chunks.clear(worker, dp_rank)
        return self.plane.clear(worker, dp_rank)

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        with self._lock:
            if stale:
                self.stale.add((worker, dp_rank))
            else:
                self.stale.discard((worker, dp_rank))
        self.plane.set_source_stale(worker, dp_rank, stale)
