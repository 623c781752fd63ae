"""Child process of the file-size-limit test: under RLIMIT_FSIZE (writes past the
limit fail with EFBIG, as on a full disk), ingest until the index refuses; report
what happened as one JSON line.

    python -m tests.persist.child_fsize PATH SEED LIMIT_BYTES
"""

from __future__ import annotations

import json
import resource
import signal
import sys

from quillcache.index.durable import DurableNativeIndex, IngestRefusedError
from tests.persist.workload import batch

WORKER = 9


def main() -> int:
    path, seed, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of dying
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    index = DurableNativeIndex(
        path, durability="per-batch", segment_bytes=64 << 20, snapshot_every_bytes=0
    )
    acked = -1
    report: dict[str, object] = {}
    for seq in range(1_000_000):
        try:
            index.apply(WORKER, [batch(seed, seq)], seqs=[seq])
        except IngestRefusedError as err:
            report["error"] = str(err)
            break
        acked = seq
    report["acked"] = acked
    # Every later change is refused too, not silently dropped or half-applied.
    refused = []
    for attempt in (
        lambda: index.apply(WORKER, [batch(seed, acked + 1)], seqs=[acked + 1]),
        lambda: index.register_source(WORKER, model="m"),
        lambda: index.remove_worker(WORKER),
    ):
        try:
            attempt()
            refused.append(False)
        except IngestRefusedError:
            refused.append(True)
    report["later_refused"] = refused
    report["last_seqs"] = {f"{k.worker}:{k.dp_rank}": v for k, v in index.last_seqs().items()}
    report["wal_failure"] = index.wal_status()["failure"]
    index.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
