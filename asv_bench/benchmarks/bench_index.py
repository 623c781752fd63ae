"""Ingest and match on the seed workload, per backend (in-memory and crash-safe)."""

from __future__ import annotations

import shutil
import tempfile

from benchmarks.common import payloads, seed
from quillcache.index import create_backend
from quillcache.index.durable import DurableNativeIndex


def _make(name: str, path: str) -> object:
    if name == "native-wal":
        return DurableNativeIndex(path)
    return create_backend(name)


class Ingest:
    params = ["native", "native-wal"]
    param_names = ["backend"]

    def setup(self, name: str) -> None:
        self.payloads = payloads()
        self.dir = tempfile.mkdtemp(prefix="asv-ingest-")
        self.n = 0

    def teardown(self, name: str) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_ingest_seed(self, name: str) -> None:
        self.n += 1
        ix = _make(name, f"{self.dir}/{self.n}")
        for i in range(0, len(self.payloads), 64):
            ix.apply(0, self.payloads[i : i + 64])
        ix.close()


class IngestMany:
    """The same payloads in one `apply_many` call per 64 chunks (native only)."""

    def setup(self) -> None:
        self.items = [(0, chunk) for chunk in _chunks(payloads(), 64)]

    def time_ingest_seed_apply_many(self) -> None:
        ix = create_backend("native")
        for i in range(0, len(self.items), 64):
            ix.apply_many(self.items[i : i + 64])  # type: ignore[attr-defined]
        ix.close()


def _chunks(items: list[bytes], n: int) -> list[list[bytes]]:
    return [items[i : i + n] for i in range(0, len(items), n)]


class Match:
    params = ["native", "native-wal"]
    param_names = ["backend"]

    def setup(self, name: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="asv-match-")
        self.ix = _make(name, f"{self.dir}/ix")
        self.ix.apply(0, payloads())
        self.queries = seed().queries[:1000]

    def teardown(self, name: str) -> None:
        self.ix.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def time_match_1000_requests(self, name: str) -> None:
        for q in self.queries:
            self.ix.match(q)
