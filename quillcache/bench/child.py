"""One phase of one backend's benchmark, in its own process (so that resident memory
and bytes written are this backend's alone, and so that it can be SIGKILLed).

    python -m quillcache.bench.child SPEC_JSON

Phases: ``ingest`` (ingest, queries; then, for a persistent backend, wait to be
killed) and ``reopen`` (time opening the directory; optionally close cleanly).
Prints one JSON line per result.
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from quillcache.bench.backends import backend_factory
from quillcache.errors import QuillCacheError


def proc_io_write_bytes() -> int:
    """Bytes this process (all threads) caused to be written to storage."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def percentiles(ns: list[int]) -> dict[str, float]:
    if not ns:
        return {"p50_us": float("nan"), "p99_us": float("nan")}
    a = np.asarray(ns, dtype=np.float64) / 1000.0
    return {"p50_us": float(np.percentile(a, 50)), "p99_us": float(np.percentile(a, 99))}


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def ingest(spec: dict[str, Any]) -> None:
    with open(spec["workload"], "rb") as f:
        w = pickle.load(f)
    path = Path(spec["path"]) if spec.get("path") else None
    rss0 = rss_bytes()
    backend = backend_factory(spec["backend"], path, spec.get("options", {}))()
    chunk = int(spec.get("chunk", 64))
    # Consecutive batches of one worker go in one call, at most `chunk` of them.
    calls: list[tuple[int, list[bytes]]] = []
    for worker, payload, _, _ in w.batches:
        if calls and calls[-1][0] == worker and len(calls[-1][1]) < chunk:
            calls[-1][1].append(payload)
        else:
            calls.append((worker, [payload]))
    io0 = proc_io_write_bytes()
    t0 = time.perf_counter()
    stored = 0
    for done, (worker, payloads) in enumerate(calls):
        try:
            stored += backend.apply(worker, payloads).blocks_stored
        except QuillCacheError as e:  # reported as this backend's result, not a crash
            emit(
                {
                    "phase": "failed",
                    "error": f"{type(e).__name__}: {e}",
                    "calls_done": done,
                    "calls": len(calls),
                    "blocks_stored": stored,
                }
            )
            backend.close()
            return
    ingest_s = time.perf_counter() - t0
    io1 = proc_io_write_bytes()
    stats = backend.stats()
    # The answers are summed into checksums that every backend must agree on.
    match_ns, matched = [], 0
    for q in w.queries:
        t = time.perf_counter_ns()
        hits = backend.match(q)
        match_ns.append(time.perf_counter_ns() - t)
        matched += sum(h.blocks for h in hits)
    scan_ns, scanned = [], 0
    for s in w.scans:
        t = time.perf_counter_ns()
        entries = backend.scan(s)
        scan_ns.append(time.perf_counter_ns() - t)
        scanned += len(entries)
    out: dict[str, Any] = {
        "phase": "ingest",
        "blocks_stored": stored,
        "batches": len(w.batches),
        "events": w.events,
        "calls": len(calls),
        "ingest_s": ingest_s,
        "blocks_per_s": stored / ingest_s if ingest_s else 0.0,
        "events_per_s": w.events / ingest_s if ingest_s else 0.0,
        "ingest_write_bytes": io1 - io0,
        "match": percentiles(match_ns),
        "scan": percentiles(scan_ns),
        "queries": len(match_ns),
        "matched_blocks_total": matched,
        "scanned_entries_total": scanned,
        "index_blocks": stats.blocks,
        "resident_pairs": stats.resident_pairs,
        "memory_bytes": stats.memory_bytes,
        "rss_bytes": rss_bytes(),
        "rss_delta_bytes": rss_bytes() - rss0,
    }
    if hasattr(backend, "wal_status"):
        out["wal"] = backend.wal_status()
    emit(out)
    if spec.get("wait_for_kill"):
        emit({"phase": "ready"})
        time.sleep(3600)
    backend.close()


def reopen(spec: dict[str, Any]) -> None:
    factory = backend_factory(spec["backend"], Path(spec["path"]), spec.get("options", {}))
    t0 = time.perf_counter()
    backend = factory()
    open_s = time.perf_counter() - t0
    stats = backend.stats()
    out: dict[str, Any] = {"phase": "reopen", "open_s": open_s, "index_blocks": stats.blocks}
    if hasattr(backend, "recovery"):
        out["recovery"] = backend.recovery()
    io0 = proc_io_write_bytes()
    backend.close()
    out["close_write_bytes"] = proc_io_write_bytes() - io0
    emit(out)


def main() -> int:
    spec = json.loads(sys.argv[1])
    {"ingest": ingest, "reopen": reopen}[spec["phase"]](spec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
