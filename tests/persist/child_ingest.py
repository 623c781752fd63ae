"""Child process of the crash tests: ingest the deterministic stream into a durable
index, one batch per `apply`, and print the sequence number of every batch AFTER
`apply` returned (i.e. acknowledged). Resumes from the index's own `last_seqs()`,
exactly as a connector asks an engine to replay from `seq + 1` after a restart.

    python -m tests.persist.child_ingest PATH DURABILITY SEED MAX_BATCHES
"""

from __future__ import annotations

import sys

from quillcache.index.durable import DurableNativeIndex
from quillcache.index.types import SourceId
from tests.persist.workload import batch

WORKER = 5


def main() -> int:
    path, durability, seed, max_batches = (
        sys.argv[1],
        sys.argv[2],
        int(sys.argv[3]),
        int(sys.argv[4]),
    )
    index = DurableNativeIndex(
        path, durability=durability, segment_bytes=16 << 10, snapshot_every_bytes=48 << 10
    )
    start = index.last_seqs().get(SourceId(WORKER, 0), -1) + 1
    print(f"start {start}", flush=True)
    for seq in range(start, max_batches):
        index.apply(WORKER, [batch(seed, seq)], seqs=[seq])
        print(seq, flush=True)
    index.close()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
