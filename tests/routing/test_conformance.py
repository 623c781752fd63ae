"""One conformance suite, run against every registered router."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings

from quillcache.errors import ConfigError
from quillcache.routing import (
    Action,
    Decision,
    Request,
    View,
    available_routers,
    create_router,
)
from tests.routing.strategies import BLOCK, COST, request_and_view

ROUTERS = available_routers()


def test_every_builtin_is_registered() -> None:
    from quillcache.routing import BUILTIN_ALIASES, BUILTIN_ORDER, router_aliases

    assert set(BUILTIN_ORDER) <= set(ROUTERS)
    # eleven distinct policies; an alias names one of them and is not counted again
    assert len(BUILTIN_ORDER) == len(set(BUILTIN_ORDER)) >= 11
    assert not set(BUILTIN_ALIASES) & set(BUILTIN_ORDER)
    assert set(BUILTIN_ALIASES.values()) <= set(BUILTIN_ORDER)
    assert router_aliases().items() >= BUILTIN_ALIASES.items()
    assert set(BUILTIN_ALIASES) <= set(ROUTERS)


@pytest.mark.parametrize("name", ROUTERS)
@settings(max_examples=50)
@given(rv=request_and_view())
def test_decision_is_well_formed(name: str, rv: tuple[Request, View]) -> None:
    request, view = rv
    before = copy.deepcopy(view.workers)
    decision = create_router(name, seed=1).route(request, view)
    assert isinstance(decision, Decision)
    assert view.workers == before, "a router must not modify the view it is given"
    if decision.rejected:
        assert decision.reason
        return
    ids = {w.worker for w in view.workers}
    assert decision.worker in ids
    # The plan covers every full block exactly once, in order.
    n = len(request.content_keys)
    pos = 0
    for step in decision.plan:
        assert step.start == pos and step.end > step.start
        pos = step.end
    assert pos == n
    assert len(decision.actions()) == n
    chosen = view.by_id(decision.worker)
    reuse = decision.blocks_by_action()[Action.REUSE]
    assert reuse <= max(chosen.gpu_blocks, chosen.pending_blocks)
    assert decision.estimate is not None
    assert decision.estimate.ttft_s > 0
    assert decision.estimate.tbt_s > 0


@pytest.mark.parametrize("name", ROUTERS)
@settings(max_examples=25)
@given(rv=request_and_view())
def test_same_seed_same_decision(name: str, rv: tuple[Request, View]) -> None:
    request, view = rv
    a = create_router(name, seed=7).route(request, view)
    b = create_router(name, seed=7).route(request, view)
    assert a == b


@pytest.mark.parametrize("name", ROUTERS)
def test_no_workers_is_a_rejection_not_a_crash(name: str) -> None:
    req = Request(1, np.zeros(0, dtype=np.uint64), 5)
    decision = create_router(name).route(req, View(workers=[], block_size=BLOCK, cost=COST))
    assert decision.rejected and "worker" in decision.reason


@pytest.mark.parametrize("name", ROUTERS)
def test_unknown_parameters_are_refused(name: str) -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        create_router(name, no_such_option=1)
