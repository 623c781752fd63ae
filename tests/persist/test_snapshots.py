"""Periodic snapshots through the Python API, and the persistence exception types."""

from __future__ import annotations

import time
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


def test_the_time_trigger_fires_while_ingest_is_idle(tmp_path: Path) -> None:
    """A timer thread takes the time-triggered snapshot with no further `apply`:
    after a close without snapshot, reopening replays nothing."""
    path = tmp_path / "ix"
    reference = NativeIndex()
    ix = DurableNativeIndex(
        path,
        snapshot_every_bytes=0,
        snapshot_log_ratio=0,
        snapshot_every_ms=50,
        snapshot_on_close=False,
    )
    n = 20
    for i in range(n):
        ix.apply(3, [batch(5, i)], seqs=[i])
        reference.apply(3, [batch(5, i)])
    deadline = time.monotonic() + 20
    while ix.wal_status()["snapshot_lsn"] != n:
        assert time.monotonic() < deadline, f"no snapshot while idle: {ix.wal_status()}"
        time.sleep(0.01)
    ix.close()
    with DurableNativeIndex(path, snapshot_on_close=False) as again:
        rec = again.recovery()
        assert rec["snapshot_lsn"] == n
        assert rec["wal_records_replayed"] == 0
        assert again.state_eq(reference)


def test_the_log_ratio_raises_the_size_trigger(tmp_path: Path) -> None:
    """min 1 KiB, ratio 1000: the first periodic snapshot comes after ~1 KiB of log,
    the next only after 1000x its size, so the rest of the log stays to replay."""
    path = tmp_path / "ix"
    options = {"snapshot_every_bytes": 1024, "snapshot_log_ratio": 1000.0, "snapshot_every_ms": 0}
    ix = DurableNativeIndex(path, snapshot_on_close=False, snapshot_in_background=False, **options)
    n = 300
    for i in range(n):
        ix.apply(9, [batch(13, i)], seqs=[i])
    first = ix.wal_status()["snapshot_lsn"]
    assert 0 < first < n // 4
    ix.close()
    with DurableNativeIndex(path, snapshot_on_close=False, **options) as again:
        rec = again.recovery()
        assert rec["snapshot_lsn"] == first
        assert rec["wal_records_replayed"] == n - first


@pytest.mark.parametrize("ratio", [-0.5, float("nan"), float("inf")])
def test_a_bad_log_ratio_is_refused_with_its_value(tmp_path: Path, ratio: float) -> None:
    with pytest.raises(errors.QuillCacheError, match="snapshot_log_ratio"):
        DurableNativeIndex(tmp_path / "ix", snapshot_log_ratio=ratio)
