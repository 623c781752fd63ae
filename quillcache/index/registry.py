"""Index backends by name: every backend, built-in or a user's, registers through the
`quillcache.index_backends` entry points (or `register_backend`), with a check that says
why it cannot be used in this installation (e.g. the extension was built without the
rocksdb feature). `bench-index`, the simulator and the gateway all take their list here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Protocol

from quillcache.errors import ConfigError, QuillCacheError, UnknownBackendError
from quillcache.index.protocol import IndexBackend

ENTRY_POINT_GROUP = "quillcache.index_backends"


class BackendClass(Protocol):
    """What an entry point names: a backend class that can say whether it is usable."""

    def __call__(self, **options: Any) -> IndexBackend: ...

    def unavailable(self) -> str | None:
        """None when this installation can open the backend, else why not."""
        ...


class BackendUnavailableError(QuillCacheError):
    """The backend is registered but cannot run here; the message says why."""


@dataclass(frozen=True)
class _Backend:
    factory: Callable[..., IndexBackend]
    unavailable: Callable[[], str | None]


_registry: dict[str, _Backend] = {}


def _always() -> str | None:
    return None


def register_backend(
    name: str,
    factory: Callable[..., IndexBackend],
    *,
    unavailable: Callable[[], str | None] = _always,
    replace: bool = False,
) -> None:
    """Register a backend factory (a class or a function) under `name`; `unavailable`
    says why it cannot be used here (None: it can)."""
    known = _registry.get(name)
    if not replace and known is not None and known.factory is not factory:
        raise ValueError(f"index backend {name!r} is already registered")
    _registry[name] = _Backend(factory, unavailable)


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _registry:
            continue
        cls = ep.load()
        check = getattr(cls, "unavailable", None)
        if not callable(check):
            raise UnknownBackendError(
                f"index backend {ep.name!r} ({ep.value}) has no unavailable() classmethod "
                "(None when usable, else why not)"
            )
        register_backend(ep.name, cls, unavailable=check)


def backend_status() -> dict[str, str | None]:
    """Every registered backend: None when usable here, else why not."""
    _load_entry_points()
    return {name: _registry[name].unavailable() for name in sorted(_registry)}


def available_backends() -> list[str]:
    """The registered backends usable in this installation."""
    return [name for name, why in backend_status().items() if why is None]


def create_backend(name: str, **options: Any) -> IndexBackend:
    """Instantiate a registered backend; unknown names list the known ones, and one that
    cannot run here says why."""
    if name not in _registry:
        _load_entry_points()
    try:
        backend = _registry[name]
    except KeyError:
        known = ", ".join(sorted(_registry)) or "none"
        raise UnknownBackendError(f"unknown index backend {name!r}; known: {known}") from None
    why = backend.unavailable()
    if why is not None:
        raise BackendUnavailableError(f"index backend {name!r} is unavailable: {why}")
    try:
        return backend.factory(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # an option of the wrong name, type or value
        raise ConfigError(f"index backend {name!r} options {options!r}: {exc}") from None
