"""The index conformance suite (`tests/index/test_conformance.py`), run unchanged
against the key-value backends: the in-memory store always, RocksDB and Holt when
the extension was built with their cargo features."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from quillcache.errors import IngestRefusedError
from quillcache.events import encode as enc
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


def _children_of_one_block(i: int, rng: random.Random) -> bytes:
    """64 one-block stores under block 1 (stored by batch 0): child links pile up
    under one parent."""
    root = [
        enc.BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[0] * 4, block_size=4)
    ]
    children = [
        enc.BlockStored(
            block_hashes=[10 + i * 64 + j],
            parent_block_hash=1,
            token_ids=[rng.randrange(0, 1 << 30) for _ in range(4)],
            block_size=4,
        )
        for j in range(64)
    ]
    return enc.encode_batch((root if i == 0 else []) + children, ts=float(i))


@needs_holt
def test_holt_slot_limit_is_a_typed_refusal_and_a_reopen_recovers_the_acknowledged_state(
    tmp_path: Path,
) -> None:
    """Holt 0.9.2 cannot split a blob frame whose 10,240-slot table is full
    (docs/persistence.md): the write that hits it raises IngestRefusedError, every
    later call too, and nothing of it reaches the disk."""
    rng = random.Random(5)
    reference = NativeIndex()
    db = HoltIndex(tmp_path / "db", sync=True)
    with pytest.raises(IngestRefusedError) as refused:
        for i in range(1_000):  # 64,000 blocks; the limit comes near 10,000
            p = _children_of_one_block(i, rng)
            db.apply(3, [p])
            reference.apply(3, [p])
    assert "slot table exhausted" in str(refused.value)
    assert "reopen" in str(refused.value)
    acknowledged = reference.stats().blocks
    assert 1_000 < acknowledged < 60_000
    with pytest.raises(IngestRefusedError, match="earlier write failed"):
        db.entries()
    with pytest.raises(IngestRefusedError, match="earlier write failed"):
        db.apply(3, [_children_of_one_block(0, rng)])
    db.close()  # only releases the store
    with HoltIndex(tmp_path / "db", sync=True) as reopened:
        got = sorted((e.key, e.holders) for e in reopened.entries())
        want = sorted((e.key, e.holders) for e in reference.entries())
        assert len(got) == acknowledged
        assert got == want
