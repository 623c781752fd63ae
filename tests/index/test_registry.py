"""Every index backend is registered, and one that cannot run here says why."""

from __future__ import annotations

import pytest

from quillcache.index import (
    BackendUnavailableError,
    backend_status,
    create_backend,
    register_backend,
)
from quillcache.index.memory import MemoryIndex
from quillcache.index.rocks import store_available

ALL = {"memory", "native", "native-wal", "kv-memory", "rocksdb", "holt"}


def test_every_backend_is_registered_with_its_availability() -> None:
    status = backend_status()
    assert set(status) >= ALL
    for name in ("memory", "native", "native-wal", "kv-memory"):
        assert status[name] is None, (name, status[name])
    for name in ("rocksdb", "holt"):  # present or not, the registry must say which
        if store_available(name):
            assert status[name] is None
            create_backend(name).close()
        else:
            assert status[name] is not None and f"{name} cargo feature" in status[name]
            with pytest.raises(BackendUnavailableError, match="cargo feature"):
                create_backend(name)


def test_an_unavailable_backend_is_refused_with_its_reason() -> None:
    register_backend(
        "test-unavailable", MemoryIndex, unavailable=lambda: "needs a GPU", replace=True
    )
    assert backend_status()["test-unavailable"] == "needs a GPU"
    with pytest.raises(BackendUnavailableError, match="needs a GPU"):
        create_backend("test-unavailable")
    register_backend("test-available", MemoryIndex, replace=True)
    assert create_backend("test-available").name == "memory"
