"""Routers by name: the built-ins plus the `quillcache.routers` entry points."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from quillcache.errors import UnknownRouterError
from quillcache.routing.base import Router

ENTRY_POINT_GROUP = "quillcache.routers"

RouterFactory = Callable[..., Router]
F = TypeVar("F", bound=RouterFactory)
_registry: dict[str, RouterFactory] = {}


def register_router(name: str, factory: RouterFactory, *, replace: bool = False) -> None:
    """Register a router class (or any factory taking keyword options) under `name`."""
    if not replace and name in _registry and _registry[name] is not factory:
        raise ValueError(f"router {name!r} is already registered")
    _registry[name] = factory


def router(name: str) -> Callable[[F], F]:
    """Class decorator form of `register_router`."""

    def wrap(factory: F) -> F:
        register_router(name, factory)
        return factory

    return wrap


def import_router(spec: str) -> RouterFactory:
    """The router class a "pkg.module:Class" spec names (a user's router, as the gateway's
    `router:` setting and `simulate --routers` take it), registered under the spec so
    `create_router(spec)` works too (also in forked worker processes)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UnknownRouterError(f"router {spec!r}: expected 'pkg.module:Class'")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise UnknownRouterError(f"router {spec!r}: cannot import it: {exc}") from None
    if not callable(factory):
        raise UnknownRouterError(f"router {spec!r} is not a class or factory")
    register_router(spec, factory, replace=True)
    return factory


def _load_entry_points() -> None:
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in _registry:
            _registry[ep.name] = ep.load()


def available_routers() -> list[str]:
    _load_entry_points()
    return sorted(_registry)


def builtin_routers() -> list[str]:
    """Built-in routers in a stable presentation order (baselines first)."""
    from quillcache.routing import BUILTIN_ORDER

    return list(BUILTIN_ORDER)


def create_router(name: str, **options: Any) -> Router:
    """Instantiate a registered router; unknown names list the known ones."""
    if name not in _registry:
        if ":" in name:
            import_router(name)
        _load_entry_points()
    try:
        factory = _registry[name]
    except KeyError:
        known = ", ".join(available_routers()) or "none"
        raise UnknownRouterError(f"unknown router {name!r}; known: {known}") from None
    return factory(**options)
