"""A full disk, a file-size limit, a read-only directory: a clear typed error, the
index refuses further changes instead of acknowledging what is not in the log, and
reopening gives back exactly the acknowledged state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from quillcache.errors import QuillCacheError
from quillcache.index.durable import (
    DurableNativeIndex,
    IngestRefusedError,
    PersistenceError,
)
from quillcache.index.native import NativeIndex
from quillcache.index.types import SourceId
from tests.persist.workload import batch

REPO = Path(__file__).resolve().parents[2]


def reference(seed: int, worker: int, n: int) -> NativeIndex:
    ref = NativeIndex()
    ref.apply(worker, [batch(seed, i) for i in range(n)])
    return ref


def test_file_size_limit_refuses_ingest_and_keeps_the_logged_state(tmp_path: Path) -> None:
    seed, limit = 11, 96 << 10
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.persist.child_fsize",
            str(tmp_path / "ix"),
            str(seed),
            str(limit),
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    acked = report["acked"]
    assert acked > 10, report
    assert "File too large" in report["error"] or "os error 27" in report["error"], report
    assert "refuses" in report["error"], report
    assert report["later_refused"] == [True, True, True], report
    assert report["last_seqs"] == {"9:0": acked}, report
    assert report["wal_failure"], report
    # The failed write left no half-frame behind that recovery would take for data.
    with DurableNativeIndex(tmp_path / "ix") as reopened:
        assert reopened.last_seqs() == {SourceId(9, 0): acked}
        assert reopened.state_eq(reference(seed, 9, acked + 1))
        assert reopened.recovery()["torn_tail"] is None


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (needs root, which the sandbox and CI have)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the RLIMIT test covers it")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_refuses_ingest_then_recovers_exactly(tiny_fs: Path) -> None:
    seed, worker = 3, 4
    index = DurableNativeIndex(
        tiny_fs / "ix", durability="per-batch", segment_bytes=1 << 20, snapshot_every_bytes=0
    )
    acked = -1
    with pytest.raises(IngestRefusedError) as excinfo:
        for seq in range(100_000):
            index.apply(worker, [batch(seed, seq)], seqs=[seq])
            acked = seq
    assert acked > 10
    message = str(excinfo.value)
    assert "No space left" in message or "os error 28" in message, message
    assert str(tiny_fs / "ix") in message, "the error must name the file"
    assert isinstance(excinfo.value, QuillCacheError)
    # Refused from now on; the in-memory state is exactly the acknowledged one.
    with pytest.raises(IngestRefusedError):
        index.apply(worker, [batch(seed, acked + 1)], seqs=[acked + 1])
    with pytest.raises(IngestRefusedError):
        index.clear_source(worker)
    assert index.last_seqs() == {SourceId(worker, 0): acked}
    expected = reference(seed, worker, acked + 1)
    assert index.state_eq(expected)
    index.close()  # closing a failed index does not try to write

    reopened = DurableNativeIndex(tiny_fs / "ix", durability="per-batch")
    assert reopened.state_eq(expected)
    assert reopened.last_seqs() == {SourceId(worker, 0): acked}
    # The disk is still full: the snapshot a clean close takes fails clearly, and the
    # log it would have replaced is left intact.
    with pytest.raises(PersistenceError) as snap:
        reopened.close()
    assert "No space left" in str(snap.value) or "os error 28" in str(snap.value)
    with DurableNativeIndex(tiny_fs / "ix", snapshot_on_close=False) as again:
        assert again.state_eq(expected)

    # A read-only file system: opening a new index there is a clear error.
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    with pytest.raises(PersistenceError) as ro:
        DurableNativeIndex(tiny_fs / "other")
    assert "Read-only" in str(ro.value) or "os error 30" in str(ro.value), str(ro.value)
