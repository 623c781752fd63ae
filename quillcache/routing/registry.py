"""Routers by name: the built-ins plus the `quillcache.routers` entry points."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from quillcache.errors import ConfigError, UnknownRouterError
from quillcache.routing.base import Router
from quillcache.routing.types import SLO

ENTRY_POINT_GROUP = "quillcache.routers"

RouterFactory = Callable[..., Router]
F = TypeVar("F", bound=RouterFactory)
_registry: dict[str, RouterFactory] = {}
# alias -> the registered name it stands for: one policy known by two names (a name
# kept for old configurations), created and scored as that policy, counted once
_aliases: dict[str, str] = {}


def register_router(name: str, factory: RouterFactory, *, replace: bool = False) -> None:
    """Register a router class (or any factory taking keyword options) under `name`."""
    if not replace and name in _registry and _registry[name] is not factory:
        raise ValueError(f"router {name!r} is already registered")
    if name in _aliases:
        raise ValueError(f"router {name!r} is already an alias of {_aliases[name]!r}")
    _registry[name] = factory


def register_alias(alias: str, name: str) -> None:
    """Make `alias` another name of the registered router `name`: `create_router(alias)`
    builds `name`'s router (whose `name` it keeps), `available_routers()` accepts it and
    `router_aliases()` lists it as an alias, never as a distinct policy."""
    if name not in _registry:
        raise ValueError(f"cannot alias {alias!r} to {name!r}: no router of that name")
    if alias in _registry:
        raise ValueError(f"alias {alias!r} is already a router's name")
    if _aliases.get(alias, name) != name:
        raise ValueError(f"{alias!r} is already an alias of {_aliases[alias]!r}")
    _aliases[alias] = name


def router_aliases() -> dict[str, str]:
    """Every alias and the router name it stands for."""
    return dict(_aliases)


def canonical_router_name(name: str) -> str:
    """The policy a name stands for: an alias's target, any other name itself."""
    return _aliases.get(name, name)


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
    """Every name `create_router` takes: the registered routers and their aliases."""
    _load_entry_points()
    return sorted([*_registry, *_aliases])


def builtin_routers() -> list[str]:
    """Built-in routers in a stable presentation order (baselines first), one name per
    distinct policy (aliases are not in it)."""
    from quillcache.routing import BUILTIN_ORDER

    return list(BUILTIN_ORDER)


#: Options every router takes by name: the default SLO of the requests it routes, which
#: the control plane's admission stage (`quillcache.controlplane.admission`) enforces
#: after any router's decision. They are peeled off before the router is built.
SLO_OPTIONS = ("ttft_slo_s", "tbt_slo_s")
# the instance attribute holding that default (set on the router, read by the stage)
_DEFAULT_SLO_ATTR = "default_slo"
# how many wrappers `default_slo` looks through (a wrapper holds the router it wraps
# as `inner`: the simulator's BookRouter, the gateway's shared-routing wrapper)
_MAX_WRAPPERS = 8


def _slo_option(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"router {name!r}: {key} must be a number of seconds, got {value!r}")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"router {name!r}: {key} must be positive and finite, got {value!r}")
    return float(value)


def set_default_slo(router: Router, slo: SLO | None) -> None:
    """Give `router` the default SLO the admission stage applies to requests that carry
    none of their own (None: no default)."""
    try:
        setattr(router, _DEFAULT_SLO_ATTR, slo)
    except AttributeError:
        raise ConfigError(
            f"router {router.name or type(router).__name__!r} cannot hold an SLO "
            "(its class has __slots__ without 'default_slo')"
        ) from None


def default_slo(router: Router) -> SLO | None:
    """The default SLO `create_router` gave `router` (from `ttft_slo_s` / `tbt_slo_s`),
    or the router it wraps (`inner`, followed through a few wrappers): a plane routes
    through a wrapper, the options were given to the router inside it."""
    current: object = router
    for _ in range(_MAX_WRAPPERS):
        slo = getattr(current, _DEFAULT_SLO_ATTR, None)
        if isinstance(slo, SLO):
            return slo
        current = getattr(current, "inner", None)
        if current is None:
            return None
    return None


def create_router(name: str, **options: Any) -> Router:
    """Instantiate a registered router (or an alias's); unknown names list the known ones.
    `ttft_slo_s` / `tbt_slo_s`, taken by every router, set its default SLO
    (`default_slo`)."""
    slo_values = {
        key: _slo_option(name, key, options.pop(key)) for key in SLO_OPTIONS if key in options
    }
    name = canonical_router_name(name)
    if name not in _registry:
        if ":" in name:
            import_router(name)
        _load_entry_points()
    try:
        factory = _registry[name]
    except KeyError:
        known = ", ".join(available_routers()) or "none"
        raise UnknownRouterError(f"unknown router {name!r}; known: {known}") from None
    try:
        built = factory(**options)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # an option of the wrong type or value
        raise ConfigError(f"router {name!r} options {options!r}: {exc}") from None
    if slo_values:
        set_default_slo(
            built, SLO(ttft_s=slo_values.get("ttft_slo_s"), tbt_s=slo_values.get("tbt_slo_s"))
        )
    return built
