"""Where decoded-and-applied events go: the `IngestSink` interface.

The connector only moves raw msgpack batches; decoding and apply happen behind
`ingest` (in Rust for the native index). `ControlPlane` implements this shape; an
`IndexSink` wraps a bare `IndexBackend` for tools and tests that need no routing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from quillcache.index.protocol import IndexBackend
from quillcache.index.types import ApplyStats


@runtime_checkable
class IngestSink(Protocol):
    def ingest(self, worker: int, payloads: Sequence[bytes], dp_rank: int = 0) -> ApplyStats:
        """Decode and apply raw event batches of one source, in order."""
        ...

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        """Forget everything one source holds (restart, unrecoverable gap)."""
        ...

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        """Mark a source's residency as unknown (True) or trusted again (False)."""
        ...


class IndexSink:
    """An `IngestSink` over one `IndexBackend`, remembering which sources are stale."""

    def __init__(self, index: IndexBackend) -> None:
        self.index = index
        self._lock = threading.Lock()
        self.stale: set[tuple[int, int]] = set()

    def ingest(self, worker: int, payloads: Sequence[bytes], dp_rank: int = 0) -> ApplyStats:
        return self.index.apply(worker, payloads, dp_rank)

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
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
    native index serialises its own readers and writers (an RwLock, GIL released), and
    ingest only touches per-worker counters of the plane besides the index. For any
    other backend, pass a `guard` (a lock the router side holds too).
    """

    def __init__(
        self, plane: Any, guard: contextlib.AbstractContextManager[Any] | None = None
    ) -> None:
        self.plane = plane
        self.guard = guard if guard is not None else contextlib.nullcontext()
        self._lock = threading.Lock()
        self.stale: set[tuple[int, int]] = set()
        # A persistent index (native-wal) records each source's last engine seq.
        self.accepts_seqs = hasattr(plane.index, "last_seqs")

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        with self.guard:
            return self._ingest(worker, payloads, dp_rank, seqs)

    def _ingest(
        self, worker: int, payloads: Sequence[bytes], dp_rank: int, seqs: Sequence[int] | None
    ) -> ApplyStats:
        if seqs is None or not self.accepts_seqs:
            return self.plane.ingest(worker, payloads, dp_rank)
        # ControlPlane.ingest takes no seqs yet: apply through the index and keep the
        # plane's per-worker count the way ingest does.
        stats: ApplyStats = self.plane.index.apply(worker, payloads, dp_rank, seqs=seqs)
        state = self.plane.worker(worker)
        state.resident_blocks = max(
            state.resident_blocks + stats.blocks_stored - stats.blocks_removed, 0
        )
        self.plane.apply_stats += stats
        return stats

    def last_seqs(self) -> dict[tuple[int, int], int]:
        """(worker, dp_rank) -> last applied seq, from a persistent index ({} otherwise)."""
        if not self.accepts_seqs:
            return {}
        return {(s.worker, s.dp_rank): q for s, q in self.plane.index.last_seqs().items()}

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        with self.guard:
            return self.plane.clear(worker, dp_rank)

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        with self._lock:
            if stale:
                self.stale.add((worker, dp_rank))
            else:
                self.stale.discard((worker, dp_rank))
        with self.guard:
            self.plane.set_source_stale(worker, dp_rank, stale)
