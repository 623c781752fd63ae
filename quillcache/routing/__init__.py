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
    available_routers,
    builtin_routers,
    create_router,
    register_router,
    router,
)
from quillcache.routing.sglang import SglangCacheAware
from quillcache.routing.ttft import MooncakeConductor, QuillGreedy
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
    QuillGreedy,
    QuillCacheRouter,
)
BUILTIN_ORDER: tuple[str, ...] = tuple(cls.name for cls in _BUILTINS)
for _cls in _BUILTINS:
    register_router(_cls.name, _cls)

__all__ = [
    "BUILTIN_ORDER",
    "ENTRY_POINT_GROUP",
    "SLO",
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
    "QuillGreedy",
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
    "create_router",
    "plan_and_estimate",
    "register_router",
    "router",
    "tier_of",
]
