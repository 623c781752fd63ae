"""Index backends kept in an ordered key-value store: RocksDB (an LSM tree) for the
ART-vs-LSM study, and an in-memory store that runs the same code without the C++
build (for tests).

The index semantics are those of `docs/index.md`, implemented once in Rust
(`quillcache_core::backends::KvIndex`): one write batch per event batch, a
prefix-friendly key layout (`N`ode, `C`hild, `E`ngine-hash, `S`ource ranges, integers
big-endian) and one multi-get per `match`. See `docs/persistence.md`.

RocksDB needs the extension built with the ``rocksdb`` cargo feature::

    maturin develop --release --features rocksdb
"""

from __future__ import annotations

import os
import shutil
import tempfile

from quillcache import _native
from quillcache.errors import QuillCacheError
from quillcache.index.native import NativeIndex

__all__ = ["KvMemoryIndex", "KvStoreIndex", "RocksDbIndex", "store_available"]


def store_available(store: str) -> bool:
    """True if this build of the extension has the key-value store `store`."""
    try:
        ix = _native.KvIndex(store, tempfile.gettempdir() if store == "memory" else None)
    except QuillCacheError as err:
        return "not available in this build" not in str(err)
    ix.close()
    return True


class KvStoreIndex(NativeIndex):
    """`IndexBackend` over `quillcache._native.KvIndex` with a given store."""

    @classmethod
    def unavailable(cls) -> str | None:
        if store_available(cls.store):
            return None
        return (
            f"the extension was built without the {cls.store} cargo feature (docs/persistence.md)"
        )

    name = "kv"
    store = "memory"

    def __init__(self, path: str | os.PathLike[str] | None = None, *, sync: bool = False) -> None:
        self._tmpdir: str | None = None
        if path is None and self.store != "memory":
            self._tmpdir = tempfile.mkdtemp(prefix=f"quillcache-{self.store}-")
            path = self._tmpdir
        self._path = None if path is None else os.fspath(path)
        inner = _native.KvIndex(self.store, self._path, sync=sync)
        super().__init__(_inner=inner)  # type: ignore[arg-type]

    @property
    def path(self) -> str | None:
        return self._path

    def disk_bytes(self) -> int:
        """Bytes of the store's files."""
        return self._inner.disk_bytes()  # type: ignore[attr-defined]

    def flush(self) -> None:
        """Make everything written durable (memtables to files, WAL fsynced)."""
        self._inner.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        """Flush and release the store (a temporary directory is deleted). Idempotent."""
        self._inner.close()  # type: ignore[attr-defined]
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> KvStoreIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KvMemoryIndex(KvStoreIndex):
    """The key-value index over an in-memory ordered map (a test vehicle)."""

    name = "kv-memory"
    store = "memory"


class RocksDbIndex(KvStoreIndex):
    """The key-value index in RocksDB (needs the ``rocksdb`` cargo feature)."""

    name = "rocksdb"
    store = "rocksdb"
