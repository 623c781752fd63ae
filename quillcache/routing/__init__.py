"""Routers: the `Router` API, the built-in policies and the registry by name.

Write your own by subclassing `Router` and registering it:

    from quillcache.routing import Router, register_router

    class FewestRequests(Router):
        name = "fewest-requests"
        def route(self, request, view):
            return self.decide(request, view, min(view.workers, key=lambda w: w.in_flight))

    register_router(FewestRequests.name, FewestRequests)

or expose it as an entry point in the `quillcache.routers` group. Every policy, with
its source, is described in `docs/routing.md`.
"""

from __future__ import annotations

from quillcache.routing.base import Router, plan_and_estimate
from quillcache.routing.baselines import (
    LeastLoaded,
    PowerOfTwo,
    RandomRouter,
    RoundRobin,
    SessionAffinity,
)
from quillcache.routing.dynamo import DynamoKvCost
from quillcache.routing.llmd import LlmdPrecisePrefix
from quillcache.routing.preble import PrebleE2
from quillcache.routing.quill import QuillCacheRouter
from quillcache.routing.registry import (
    ENTRY_POINT_GROUP,
    SLO_OPTIONS,
    available_routers,
    builtin_routers,
    canonical_router_name,
    create_router,
    default_slo,
    register_alias,
    register_router,
    router,
    router_aliases,
    set_default_slo,
)
from quillcache.routing.sglang import SglangCacheAware
from quillcache.routing.ttft import MooncakeConductor
from quillcache.routing.types import (
    SLO,
    Action,
    Decision,
    Estimate,
    PlanStep,
    Request,
    View,
    WorkerView,
    tier_of,
)

_BUILTINS: tuple[type[Router], ...] = (
    RoundRobin,
    RandomRouter,
    LeastLoaded,
    PowerOfTwo,
    SessionAffinity,
    DynamoKvCost,
    SglangCacheAware,
    LlmdPrecisePrefix,
    PrebleE2,
    MooncakeConductor,
    QuillCacheRouter,
)
# one name per distinct policy: the simulator's and bench-route's "all"
BUILTIN_ORDER: tuple[str, ...] = tuple(cls.name for cls in _BUILTINS)
for _cls in _BUILTINS:
    register_router(_cls.name, _cls)
# QuillCache's first router: the same argmin of estimated TTFT over the same tiers as
# Mooncake's Conductor, identical decisions; the name stays accepted everywhere
BUILTIN_ALIASES: dict[str, str] = {"quillcache-greedy": MooncakeConductor.name}
for _alias, _name in BUILTIN_ALIASES.items():
    register_alias(_alias, _name)

__all__ = [
    "BUILTIN_ALIASES",
    "BUILTIN_ORDER",
    "ENTRY_POINT_GROUP",
    "SLO",
    "SLO_OPTIONS",
    "Action",
    "Decision",
    "DynamoKvCost",
    "Estimate",
    "LeastLoaded",
    "LlmdPrecisePrefix",
    "MooncakeConductor",
    "PlanStep",
    "PowerOfTwo",
    "PrebleE2",
    "QuillCacheRouter",
    "RandomRouter",
    "Request",
    "RoundRobin",
    "Router",
    "SessionAffinity",
    "SglangCacheAware",
    "View",
    "WorkerView",
    "available_routers",
    "builtin_routers",
    "canonical_router_name",
    "create_router",
    "default_slo",
    "plan_and_estimate",
    "register_alias",
    "register_router",
    "router",
    "router_aliases",
    "set_default_slo",
    "tier_of",
]
