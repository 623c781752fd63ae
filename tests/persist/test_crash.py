"""SIGKILL a real ingesting process at random moments, many times over, and check
that every recovery gives back exactly the acknowledged state.

What "acknowledged" guarantees here: the child prints a batch's seq only after
`apply` returned, and `apply` returns only once the batch is written to the log
(in the kernel: it survives the death of the process in every durability mode;
fsync, which the modes differ in, matters for the death of the machine, which a
test cannot stage). So after each SIGKILL the recovered index must hold every
printed batch, and at most one more (the batch whose `apply` returned but whose
print was cut off) — never fewer, never a gap, never a different state. The
recovered per-source `last_seqs()` tells which; the index must then equal a
reference replay of exactly that prefix. The next child resumes from
`last_seqs() + 1`, as a connector asks an engine for replay.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quillcache.index.durable import DurableNativeIndex
from quillcache.index.native import NativeIndex
from quillcache.index.types import SourceId
from tests.persist.child_ingest import WORKER
from tests.persist.workload import batch

REPO = Path(__file__).resolve().parents[2]
CYCLES = 8


def start_child(path: Path, durability: str, seed: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.persist.child_ingest",
            str(path),
            durability,
            str(seed),
            "1000000",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("durability", ["per-batch", "interval:10", "none"])
def test_sigkill_at_random_moments_loses_nothing_acknowledged(
    tmp_path: Path, durability: str
) -> None:
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    path = tmp_path / "index"
    reference = NativeIndex()
    applied = 0  # batches in the reference (and, after each check, in the durable index)
    torn_seen = 0
    for cycle in range(CYCLES):
        child = start_child(path, durability, seed)
        assert child.stdout is not None
        first = child.stdout.readline()
        assert first.startswith("start "), (first, child.stderr.read() if child.stderr else "")
        assert int(first.split()[1]) == applied, "the child must resume after the recovered seq"
        time.sleep(rng.uniform(0.0, 0.25))
        child.send_signal(signal.SIGKILL)
        # Read through the same buffered file object readline() used (communicate()
        # would bypass its buffer and drop the lines already read ahead).
        assert child.stderr is not None
        out, err = child.stdout.read(), child.stderr.read()
        child.wait(timeout=30)
        assert child.returncode == -signal.SIGKILL, (child.returncode, err)
        acked = [int(line) for line in out.split()]
        assert acked == list(range(applied, applied + len(acked))), "acks out of order"
        last_acked = acked[-1] if acked else applied - 1

        recovered = DurableNativeIndex(path, durability=durability, snapshot_on_close=False)
        try:
            info = recovered.recovery()
            torn_seen += info["torn_tail"] is not None
            n = recovered.last_seqs().get(SourceId(WORKER, 0), -1) + 1
            assert last_acked + 1 <= n <= last_acked + 2, (
                f"cycle {cycle} (seed {seed}): acknowledged up to {last_acked}, "
                f"recovered up to {n - 1}"
            )
            for i in range(applied, n):
                reference.apply(WORKER, [batch(seed, i)])
            applied = n
            assert recovered.state_eq(reference), f"cycle {cycle} (seed {seed}): state differs"
        finally:
            recovered.close()
    assert applied > CYCLES, "the children hardly ingested anything: the test proved little"
    print(f"{durability}: {applied} batches over {CYCLES} kills, {torn_seen} torn tails")


def test_clean_shutdown_then_reopen_equals_reference(tmp_path: Path) -> None:
    seed = 7
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.persist.child_ingest",
            str(tmp_path / "ix"),
            "none",
            str(seed),
            "300",
        ],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.split()[-1] == "done"
    reference = NativeIndex()
    reference.apply(WORKER, [batch(seed, i) for i in range(300)])
    with DurableNativeIndex(tmp_path / "ix") as reopened:
        info = reopened.recovery()
        assert info["snapshot_lsn"] == 300, info  # a clean close leaves a snapshot ...
        assert info["wal_records_replayed"] == 0, info  # ... and nothing to replay
        assert reopened.last_seqs() == {SourceId(WORKER, 0): 299}
        assert reopened.state_eq(reference)
