"""Routers by name: user subclasses, the decorator, typed errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings

from quillcache.errors import QuillCacheError, UnknownRouterError
from quillcache.routing import (
    Decision,
    Request,
    Router,
    View,
    available_routers,
    create_router,
    register_alias,
    register_router,
    router,
    router_aliases,
)
from tests.routing.strategies import COST, request_and_view


class FewestRequests(Router):
    name = "test-fewest-requests"

    def route(self, request: Request, view: View) -> Decision:
        return self.decide(request, view, min(view.workers, key=lambda w: w.in_flight))


def test_user_subclass_registers_and_routes() -> None:
    from quillcache.routing import WorkerView

    register_router(FewestRequests.name, FewestRequests)
    assert FewestRequests.name in available_routers()
    r = create_router(FewestRequests.name, seed=3)
    assert isinstance(r, FewestRequests) and r.seed == 3
    view = View([WorkerView(0, in_flight=4), WorkerView(1, in_flight=1)], 16, COST)
    d = r.route(Request(1, np.array([5], dtype=np.uint64), 20), view)
    assert d.worker == 1 and d.estimate is not None


def test_decorator_and_duplicate_names() -> None:
    @router("test-decorated")
    class Decorated(FewestRequests):
        name = "test-decorated"

    assert isinstance(create_router("test-decorated"), Decorated)

    class Other(FewestRequests):
        pass

    with pytest.raises(ValueError, match="already registered"):
        register_router("test-decorated", Other)
    register_router("test-decorated", Other, replace=True)
    assert type(create_router("test-decorated")) is Other


def test_unknown_router_is_a_typed_error_listing_the_known_ones() -> None:
    with pytest.raises(UnknownRouterError) as info:
        create_router("no-such-router")
    assert isinstance(info.value, QuillCacheError)
    assert "no-such-router" in str(info.value) and "round-robin" in str(info.value)


def test_quillcache_greedy_is_an_alias_of_mooncake() -> None:
    from quillcache.routing import BUILTIN_ORDER, MooncakeConductor

    assert router_aliases()["quillcache-greedy"] == "mooncake"
    # accepted by name (simulate, gateway, bench-route check available_routers) ...
    assert "quillcache-greedy" in available_routers()
    r = create_router("quillcache-greedy", seed=4)
    assert type(r) is MooncakeConductor and r.name == "mooncake" and r.seed == 4
    # ... and not a distinct policy of the tables
    assert "quillcache-greedy" not in BUILTIN_ORDER and "mooncake" in BUILTIN_ORDER


@settings(max_examples=60)
@given(rv=request_and_view())
def test_an_alias_decides_as_its_router(rv: tuple[Request, View]) -> None:
    request, view = rv
    assert create_router("quillcache-greedy", seed=2).route(request, view) == create_router(
        "mooncake", seed=2
    ).route(request, view)


def test_alias_registration_errors() -> None:
    with pytest.raises(ValueError, match="no router of that name"):
        register_alias("test-alias-nowhere", "no-such-router")
    with pytest.raises(ValueError, match="already a router's name"):
        register_alias("round-robin", "random")
    with pytest.raises(ValueError, match="already an alias"):
        register_alias("quillcache-greedy", "random")
    with pytest.raises(ValueError, match="already an alias"):
        register_router("quillcache-greedy", FewestRequests)
    register_alias("quillcache-greedy", "mooncake")  # the same alias again: no change
    assert router_aliases()["quillcache-greedy"] == "mooncake"
