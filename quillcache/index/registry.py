"""Index backends by name: built-ins plus the `quillcache.index_backends` entry points."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from quillcache.errors import UnknownBackendError
from quillcache.index.protocol import IndexBackend

ENTRY_POINT_GROUP = "quillcache.index_backends"

BackendFactory = Callable[..., IndexBackend]
_registry: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory, *, replace: bool = False) -> None:
    """Register an index backend factory (a class or a function) under `name`."""
    if not replace and name in _registry and _registry[name] is not factory:
        raise ValueError(f"index backend {name!r} is already registered")
    _registry[name] = factory


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registry:
            _registry[ep.name] = ep.load()


def available_backends() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def create_backend(name: str, **options: Any) -> IndexBackend:
    """Instantiate a registered backend; unknown names list the known ones."""
    if name not in _registry:
        _load_entry_points()
    try:
        factory = _registry[name]
    except KeyError:
        known = ", ".join(available_backends()) or "none"
        raise UnknownBackendError(f"unknown index backend {name!r}; known: {known}") from None
    return factory(**options)
