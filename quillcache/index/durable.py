"""`DurableNativeIndex` ("native-wal"): the native index made crash-safe.

Every change is appended to a write-ahead log (checksummed frames, group commit)
before it is applied; snapshots bound the log. After a crash, opening the same
directory gives back exactly the state of every acknowledged call (see
`docs/persistence.md` for what "acknowledged" means under each durability setting),
plus the last engine sequence number applied per source, so that a connector can ask
each engine to replay from `seq + 1`.

Durability: ``"none"`` (never fsync), ``"per-batch"`` (fsync before `apply`
returns) or ``"interval:<ms>"`` (fsync in the background at most every N ms; the
default, ``"interval:10"``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from typing import Any

from quillcache import _native
from quillcache._native import (
    CorruptIndexError,
    IndexLockedError,
    IngestRefusedError,
    PersistenceError,
)
from quillcache.errors import EventDecodeError
from quillcache.index.inputs import check_source
from quillcache.index.native import NativeIndex
from quillcache.index.types import ApplyStats, SourceId

__all__ = [
    "DEFAULT_DURABILITY",
    "CorruptIndexError",
    "DurableNativeIndex",
    "IndexLockedError",
    "IngestRefusedError",
    "PersistenceError",
]

DEFAULT_DURABILITY = "interval:10"


class DurableNativeIndex(NativeIndex):
    """`IndexBackend` over `quillcache._native.DurableIndex` (index + WAL + snapshots).

    `path=None` uses a fresh temporary directory, deleted on `close()` (handy for
    tests and benchmarks; a real deployment passes a path).
    """

    name = "native-wal"

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        durability: str = DEFAULT_DURABILITY,
        segment_bytes: int = 64 << 20,
        snapshot_every_bytes: int = 4 << 20,
        snapshot_log_ratio: float = 0.125,
        snapshot_every_ms: int = 60_000,
        snapshot_in_background: bool = True,
        snapshot_on_close: bool = True,
    ) -> None:
        self._tmpdir: str | None = None
        if path is None:
            self._tmpdir = tempfile.mkdtemp(prefix="quillcache-wal-")
            path = self._tmpdir
        inner = _native.DurableIndex(
            os.fspath(path),
            durability=durability,
            segment_bytes=segment_bytes,
            snapshot_every_bytes=snapshot_every_bytes,
            snapshot_log_ratio=snapshot_log_ratio,
            snapshot_every_ms=snapshot_every_ms,
            snapshot_in_background=snapshot_in_background,
            snapshot_on_close=snapshot_on_close,
        )
        super().__init__(_inner=inner)  # type: ignore[arg-type]
        # the same object, typed with the persistence methods the base class lacks
        self._durable = inner

    @property
    def path(self) -> str:
        return os.fspath(self._durable.path)

    @property
    def durability(self) -> str:
        """``none``, ``per-batch`` or ``interval:<ms>``."""
        return self._durable.durability

    def apply(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        *,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        """As `IndexBackend.apply`; `seqs` are the engines' sequence numbers of the
        batches (one per payload), remembered per source for replay after a restart.
        When it returns, the batches are logged (and fsynced with ``per-batch``)."""
        check_source(worker, dp_rank)
        batch = [p if type(p) is bytes else bytes(p) for p in payloads]
        seq_list = None if seqs is None else [int(s) for s in seqs]
        try:
            return ApplyStats(*self._durable.apply(worker, batch, dp_rank, seq_list))
        except EventDecodeError as err:
            err.stats = ApplyStats(*err.stats)
            raise

    def last_seqs(self) -> dict[SourceId, int]:
        """The last sequence number applied per source (only sources given `seqs`)."""
        raw = self._durable.last_seqs()
        return {SourceId(w, r): s for (w, r), s in raw.items()}

    def snapshot(self) -> int:  # type: ignore[override]
        """Write a snapshot now and drop the log it covers; returns the lsn covered."""
        return self._durable.snapshot()

    @classmethod
    def from_snapshot(cls, data: bytes) -> NativeIndex:
        """A plain in-memory `NativeIndex` from an index image (see `to_native`)."""
        return NativeIndex.from_snapshot(data)

    def sync(self) -> int:
        """fsync the log now, whatever the durability; returns the lsn now durable."""
        return self._durable.sync()

    def recovery(self) -> dict[str, Any]:
        """What opening did: snapshot lsn/bytes/load time, log records replayed,
        torn tail (path, offset, bytes dropped) or None, total time in seconds."""
        return self._durable.recovery()

    def wal_status(self) -> dict[str, Any]:
        """`last_lsn`, `synced_lsn`, `snapshot_lsn`, `disk_bytes`, `failure` (a write
        failed: changes are refused), `snapshot_error` (the last background snapshot
        failed: nothing is lost, the log is just not pruned)."""
        return self._durable.wal_status()

    def to_native(self) -> NativeIndex:
        """An in-memory copy of the current state (for checks and comparisons)."""
        return NativeIndex.from_snapshot(self._durable.index_image())

    def state_eq(self, other: NativeIndex) -> bool:
        mine = self.to_native()
        theirs = other.to_native() if isinstance(other, DurableNativeIndex) else other
        return mine.state_eq(theirs)

    def close(self) -> None:
        """Snapshot (unless disabled), fsync and release the directory. Idempotent."""
        self._inner.close()  # type: ignore[attr-defined]
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> DurableNativeIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
