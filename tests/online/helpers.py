"""Shared helpers of the online tests: polling with a deadline, free ports, sinks."""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Callable, Sequence

import httpx
import msgpack

from quillcache.errors import EventDecodeError
from quillcache.index.types import ApplyStats


def wait_for(cond: Callable[[], object], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RecordingSink:
    """An IngestSink that decodes each batch with msgpack and records its timestamp.

    The tests publish batch i with ts = i, so `applied` is the exact order of batches
    that reached the index; `clears` and `stale` record what the ingestor decided.
    """

    def __init__(self, delay_s: float = 0.0) -> None:
        self.applied: dict[tuple[int, int], list[float]] = {}
        self.clears: list[tuple[int, int]] = []
        self.stale: dict[tuple[int, int], bool] = {}
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        if self.delay_s:
            time.sleep(self.delay_s)
        stats = ApplyStats()
        for i, payload in enumerate(payloads):
            try:
                batch = msgpack.unpackb(payload)
                ts = float(batch[0])
            except Exception as exc:
                err = EventDecodeError(f"batch {i}: {exc}")
                err.payload_index = i  # the IngestSink contract
                err.stats = stats
                raise err from exc
            with self.lock:
                self.applied.setdefault((worker, dp_rank), []).append(ts)
            stats.batches += 1
        return stats

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        with self.lock:
            self.clears.append((worker, dp_rank))
            self.applied[(worker, dp_rank)] = []
        return 0

    def set_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        with self.lock:
            self.stale[(worker, dp_rank)] = stale

    def seen(self, worker: int = 0, dp_rank: int = 0) -> list[float]:
        with self.lock:
            return list(self.applied.get((worker, dp_rank), []))


# Generous timeouts: the e2e tests share two cores with everything else on the machine.
http_post = functools.partial(httpx.post, timeout=30.0)
http_get = functools.partial(httpx.get, timeout=30.0)
