"""`quillcache bench-index` end to end on a small synthetic workload: real child
processes, a real SIGKILL, real /proc/self/io accounting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.bench import workloads
from quillcache.bench.runner import BenchError, _lines

REPO = Path(__file__).resolve().parents[2]


def test_bench_index_reports_every_measure(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    proc = subprocess.run(
        [
            sys.executable, "-m", "quillcache", "bench-index",
            "--backend", "native,native-wal,holt",
            "--workload", "synthetic", "--requests", "400", "--queries", "300",
            "--json", str(out), "--plot", str(plot),
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "native-wal" in proc.stdout  # the table
    report = json.loads(out.read_text())
    assert plot.stat().st_size > 0
    w = workloads.synthetic(requests=400, queries=300)
    assert report["workload"]["blocks"] == w.blocks
    by_name = {r["backend"]: r for r in report["results"]}
    holt = by_name["holt"]
    if "skipped" in holt:  # only when the extension was built without the feature
        assert "cargo feature" in holt["skipped"], holt["skipped"]
    else:  # per-write fsync: the blocks survive the SIGKILL (the runner checks it)
        assert holt["recovery_kill_s"] > 0 and holt["blocks_stored"] == w.blocks
    payload_bytes = sum(len(b[1]) for b in w.batches)
    for name in ("native", "native-wal"):
        r = by_name[name]
        assert r["blocks_stored"] == w.blocks
        assert r["resident_pairs"] == w.resident_blocks  # (block, worker) pairs
        assert r["blocks_per_s"] > 0 and r["queries"] == 300
        assert 0 < r["match"]["p50_us"] <= r["match"]["p99_us"]
        assert 0 < r["scan"]["p50_us"] <= r["scan"]["p99_us"]
    # Same answers from both: the checksums of the match and scan results agree.
    for key in ("matched_blocks_total", "scanned_entries_total"):
        assert by_name["native"][key] == by_name["native-wal"][key] > 0
    wal = by_name["native-wal"]
    # The log holds every payload: the bytes measured written cannot be fewer.
    assert wal["ingest_write_bytes"] >= payload_bytes
    assert wal["write_bytes_per_block"] >= payload_bytes / w.blocks
    assert wal["recovery_kill_s"] > 0 and wal["recovery_clean_s"] > 0
    assert wal["recovery_kill_detail"]["wal_records_replayed"] > 0
    assert wal["disk_bytes"] > 0
    assert "recovery_kill_s" not in by_name["native"]


def test_a_child_whose_ingest_fails_is_reported_with_its_error() -> None:
    """A backend that raises during ingest (e.g. Holt's slot limit) is a failed
    result with the error and how far it got, not a child traceback."""
    line = json.dumps(
        {
            "phase": "failed",
            "error": "IngestRefusedError: holt error: alloc: blob slot table exhausted",
            "calls_done": 360,
            "calls": 10529,
            "blocks_stored": 9959,
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", f"print({line!r})"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with pytest.raises(BenchError) as err:
        _lines(proc, until="ready")
    assert "slot table exhausted" in str(err.value)
    assert "after 360 of 10,529 apply calls, 9,959 blocks stored" in str(err.value)
