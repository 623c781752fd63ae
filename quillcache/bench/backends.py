"""Backends by name for the benchmark, with their persistence capabilities."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from quillcache.index.protocol import IndexBackend

#: Backends that keep their state on disk (recovery is measured for these).
PERSISTENT = {"native-wal", "rocksdb", "holt"}


def available(name: str) -> tuple[bool, str]:
    """(usable in this build, why not), from the backend registry."""
    from quillcache.index import backend_status

    status = backend_status()
    if name not in status:
        return False, f"unknown backend {name!r}; registered: {', '.join(status)}"
    why = status[name]
    return why is None, why or ""


def backend_factory(
    name: str, path: Path | None, options: dict[str, Any]
) -> Callable[[], IndexBackend]:
    """A function that opens the backend. Imports happen here, so that timing the
    call (recovery) measures opening the index, not importing Python modules."""
    if name == "native-wal":
        from quillcache.index.durable import DurableNativeIndex

        durability = options.get("durability", "interval:10")
        snapshots = {
            k: options[k] for k in ("snapshot_every_bytes", "snapshot_log_ratio") if k in options
        }
        return lambda: DurableNativeIndex(path, durability=durability, **snapshots)
    if name in ("rocksdb", "kv-memory", "holt"):
        from quillcache.index.holt import HoltIndex
        from quillcache.index.rocks import KvMemoryIndex, RocksDbIndex

        if name == "kv-memory":
            return KvMemoryIndex
        if name == "rocksdb":
            # RocksDB write(2)s its WAL on every write batch: it survives a SIGKILL
            # without an fsync (the guarantee of native-wal's default).
            return lambda: RocksDbIndex(path, sync=False)
        # Holt 0.9.2 keeps unsynced WAL records in user-space buffers (an in-RAM ring,
        # then a 64 KiB write buffer) and has no public call that only drains them, so
        # only per-write fsync survives a SIGKILL (docs/persistence.md, "Holt").
        return lambda: HoltIndex(path, sync=True)
    from quillcache.index import create_backend

    return lambda: create_backend(name)
