"""Reopening a crash-safe index: from its log alone, and from a snapshot."""

from __future__ import annotations

import shutil
import tempfile

from benchmarks.common import payloads
from quillcache.index.durable import DurableNativeIndex


class Recovery:
    params = ["wal", "snapshot"]
    param_names = ["from"]

    def setup(self, source: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="asv-recovery-")
        # "wal": no snapshot at all (no periodic one either), so reopening replays the log.
        ix = DurableNativeIndex(
            self.dir,
            snapshot_on_close=source == "snapshot",
            snapshot_every_bytes=0,
            snapshot_log_ratio=0,
            snapshot_every_ms=0,
        )
        ix.apply(0, payloads())
        ix.close()

    def teardown(self, source: str) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_reopen_seed(self, source: str) -> None:
        DurableNativeIndex(self.dir, snapshot_on_close=False).close()
