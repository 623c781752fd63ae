"""Periodic snapshots through the Python API, and the persistence exception types."""

from __future__ import annotations

from pathlib import Path

import pytest

from quillcache import _native, errors
from quillcache.index.durable import DurableNativeIndex
from quillcache.index.native import NativeIndex
from tests.persist.workload import batch

PERSISTENCE_ERRORS = [
    "PersistenceError",
    "CorruptIndexError",
    "IngestRefusedError",
    "IndexLockedError",
]


@pytest.mark.parametrize("name", PERSISTENCE_ERRORS)
def test_persistence_errors_live_in_the_package_module(name: str) -> None:
    exc = getattr(_native, name)
    assert exc.__module__ == "quillcache._native"
    assert getattr(errors, name) is exc
    assert issubclass(exc, errors.QuillCacheError)


@pytest.mark.parametrize("trigger", ["bytes", "time"])
def test_periodic_snapshots_keep_the_replayed_tail_short(tmp_path: Path, trigger: str) -> None:
    """Background snapshots by log size or by time: reopening after the process
    state is dropped without `close` (no snapshot on close) replays only the tail."""
    options = (
        {"snapshot_every_bytes": 4096, "snapshot_every_ms": 0}
        if trigger == "bytes"
        else {"snapshot_every_bytes": 0, "snapshot_every_ms": 1}
    )
    path = tmp_path / "ix"
    reference = NativeIndex()
    ix = DurableNativeIndex(path, snapshot_on_close=False, **options)
    n = 300
    for i in range(n):
        ix.apply(7, [batch(11, i)], seqs=[i])
        reference.apply(7, [batch(11, i)])
    assert ix.wal_status()["snapshot_error"] is None
    ix.close()
    again = DurableNativeIndex(path, snapshot_on_close=False, **options)
    rec = again.recovery()
    assert rec["snapshot_lsn"] is not None and rec["snapshot_lsn"] > 0
    assert rec["wal_records_replayed"] < n
    assert rec["snapshot_lsn"] + rec["wal_records_replayed"] == n
    assert again.state_eq(reference)
    assert list(again.last_seqs().values()) == [n - 1]
    again.close()
