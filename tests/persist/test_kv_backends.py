"""The index conformance suite (`tests/index/test_conformance.py`), run unchanged
against the key-value backends: the in-memory store always, RocksDB and Holt when
the extension was built with their cargo features."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from quillcache.index.holt import HoltIndex
from quillcache.index.native import NativeIndex
from quillcache.index.rocks import KvMemoryIndex, KvStoreIndex, RocksDbIndex, store_available
from tests.index import test_conformance as conformance
from tests.persist.workload import batch

HAVE_ROCKSDB = store_available("rocksdb")
HAVE_HOLT = store_available("holt")
needs_rocksdb = pytest.mark.skipif(
    not HAVE_ROCKSDB, reason="extension built without the rocksdb feature (see docs/persistence.md)"
)
needs_holt = pytest.mark.skipif(
    not HAVE_HOLT, reason="extension built without the holt feature (see docs/persistence.md)"
)
KV_BACKENDS = [
    pytest.param(KvMemoryIndex, id="kv-memory"),
    pytest.param(RocksDbIndex, id="rocksdb", marks=[pytest.mark.rocksdb, needs_rocksdb]),
    pytest.param(HoltIndex, id="holt", marks=[needs_holt]),
]


@pytest.fixture(params=KV_BACKENDS)
def index(request: pytest.FixtureRequest) -> Iterator[KvStoreIndex]:
    backend = request.param()
    yield backend
    backend.close()


# Every conformance test, collected here with the fixture above.
for _name in dir(conformance):
    if _name.startswith("test_"):
        globals()[_name] = getattr(conformance, _name)


@pytest.mark.parametrize(
    "cls",
    [
        pytest.param(RocksDbIndex, id="rocksdb", marks=[pytest.mark.rocksdb, needs_rocksdb]),
        pytest.param(HoltIndex, id="holt", marks=[needs_holt]),
    ],
)
def test_persistent_kv_reopens_with_the_same_state(tmp_path: Path, cls: type[KvStoreIndex]) -> None:
    seed = 21
    reference = NativeIndex()
    with cls(tmp_path / "db") as db:
        for i in range(200):
            p = batch(seed, i)
            db.apply(3, [p])
            reference.apply(3, [p])
        assert db.disk_bytes() > 0
    with cls(tmp_path / "db") as db:
        got = sorted((e.key, e.holders, e.pinned) for e in db.entries())
        want = sorted((e.key, e.holders, e.pinned) for e in reference.entries())
        assert got == want
        some = np.array([e.key for e in reference.entries()][:1], dtype=np.uint64)
        assert db.match(some) == reference.match(some)
