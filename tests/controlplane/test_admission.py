"""SLO admission (quillcache/controlplane/admission.py): the same stage after every router."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.admission import admit, effective_slo, loaded_estimate
from quillcache.costmodel import prefill_pairs
from quillcache.errors import ConfigError
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.routing import (
    BUILTIN_ALIASES,
    BUILTIN_ORDER,
    SLO,
    Decision,
    Estimate,
    Request,
    Router,
    View,
    WorkerView,
    create_router,
    default_slo,
    plan_and_estimate,
)
from tests.routing.strategies import COST

BS = 16
MODEL = "admission-model"
NS = namespace_id(model=MODEL, block_size=BS)
TOKENS = list(range(1000, 1000 + 40 * BS))  # 40 blocks
ROUTERS = [*BUILTIN_ORDER, *BUILTIN_ALIASES]


def _request(rid: int = 1, slo: SLO | None = None) -> Request:
    keys = np.array(content_keys(TOKENS, BS, NS), dtype=np.uint64)
    return Request(rid, keys, len(TOKENS) + 5, session_id="s1", slo=slo)


def _plane(router: str, **options: Any) -> ControlPlane:
    """Three workers: 0 holds 30 blocks of the prompt but has a long queue, 1 a short
    queue and many decodes, 2 idle: the routers disagree on where the request goes."""
    plane = ControlPlane(index="native", router=router, block_size=BS, router_options=options)
    for w in range(3):
        plane.add_worker(w, capacity_blocks=10_000, model=MODEL)
    hashes = list(range(1, 31))
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=TOKENS[: 30 * BS],
        block_size=BS,
        medium="GPU",
    )
    plane.ingest(0, [encode_batch([stored], 1.0, 0)])
    plane.update_load(0, queued_prefill_tokens=30_000, in_flight=6)
    plane.update_load(
        1, queued_prefill_tokens=500, in_flight=40, running_decodes=40, mean_context_tokens=3_000
    )
    return plane


def _unconstrained(router: str) -> tuple[Decision, Estimate]:
    """The router's choice without any SLO, and the admission stage's estimate for it."""
    plane = _plane(router)
    view = plane.view(_request())
    d = plane.route(_request())
    assert d.worker is not None and d.dp_rank is not None
    est = loaded_estimate(_request(), view, view.by_id(d.worker, d.dp_rank))
    plane.close()
    return d, est


def _nothing_pending(plane: ControlPlane) -> bool:
    return all(w.pending_blocks == 0 for w in plane.view(_request(rid=99)).workers)


@pytest.mark.parametrize("name", ROUTERS)
def test_every_router_is_held_to_the_ttft_slo_on_the_engine_it_chose(name: str) -> None:
    d, est = _unconstrained(name)
    tight = _plane(name, ttft_slo_s=est.ttft_s * 0.999)
    rejected = tight.route(_request())
    assert rejected.rejected and rejected.estimate == est
    assert "TTFT" in rejected.reason and f"worker {d.worker}" in rejected.reason
    assert _nothing_pending(tight), "a rejected request must not be booked"
    loose = _plane(name, ttft_slo_s=est.ttft_s * 1.001)
    admitted = loose.route(_request())
    assert (admitted.worker, admitted.dp_rank) == (d.worker, d.dp_rank)
    assert not _nothing_pending(loose)


@pytest.mark.parametrize("name", ROUTERS)
def test_every_router_is_held_to_the_tbt_slo_and_the_requests_own(name: str) -> None:
    d, est = _unconstrained(name)
    assert (
        _plane(name, tbt_slo_s=est.tbt_s * 0.999)
        .route(_request())
        .reason.startswith("estimated TBT")
    )
    assert _plane(name, tbt_slo_s=est.tbt_s * 1.001).route(_request()).worker == d.worker
    # the request's own bound first; a bound it leaves unset comes from the default
    assert _plane(name).route(_request(slo=SLO(ttft_s=est.ttft_s * 0.999))).rejected
    loose_own = _request(slo=SLO(ttft_s=est.ttft_s * 1.001))
    assert _plane(name, ttft_slo_s=est.ttft_s * 0.5).route(loose_own).worker == d.worker
    tbt_only = _request(slo=SLO(tbt_s=est.tbt_s * 1.001))
    assert _plane(name, ttft_slo_s=est.ttft_s * 0.5).route(tbt_only).rejected


def test_the_routers_disagree_on_this_fleet() -> None:
    # the test above is only worth something if the chosen engines (so the estimates)
    # differ between routers
    chosen = {name: _unconstrained(name)[0].worker for name in BUILTIN_ORDER}
    assert len(set(chosen.values())) >= 2, chosen


@settings(max_examples=60)
@given(
    ttft=st.floats(0.001, 20.0),
    tbt=st.floats(0.001, 0.5),
    queued=st.integers(0, 200_000),
    context=st.sampled_from([0, 500, 30_000]),
    decodes=st.integers(0, 300),
    own=st.booleans(),
)
def test_admission_rejects_exactly_when_an_estimate_exceeds_a_bound(
    ttft: float, tbt: float, queued: int, context: int, decodes: int, own: bool
) -> None:
    # the queue: requests of 1,000 new tokens each after `context` cached ones
    pairs = -(-queued // 1_000) * prefill_pairs(1_000, context)
    w = WorkerView(
        3,
        queued_prefill_tokens=queued,
        queued_prefill_pairs=pairs,
        running_decodes=decodes,
        mean_context_tokens=2_000,
    )
    view = View([w], 16, COST)
    request = Request(1, np.arange(1, 41, dtype=np.uint64), 645)
    slo = SLO(ttft_s=ttft, tbt_s=tbt)
    if own:
        request.slo = slo
    decision = create_router("round-robin").route(request, view)
    out = admit(request, view, decision, None if own else slo)
    # the reference: the plan's estimate, its TTFT at least the queue and the prefill
    # sharing steps with the decodes, as a promise (packed steps; nothing cached here,
    # no slot wait: in_flight 0)
    _, est = plan_and_estimate(request, view, w)
    loaded = COST.packed_prefill_time(
        queued_tokens=queued,
        queued_pairs=pairs,
        new_tokens=645,
        context_tokens=0,
        running_decodes=decodes,
        mean_context_tokens=2_000,
    )
    est_ttft = max(est.ttft_s, est.transfer_s + loaded)
    assert out.rejected == (est_ttft > ttft or est.tbt_s > tbt)
    if not out.rejected:
        assert out is decision


@settings(max_examples=60)
@given(
    queued=st.integers(0, 100_000),
    decodes=st.integers(0, 300),
    in_flight=st.integers(0, 600),
    cached=st.integers(0, 40),
)
def test_the_stage_estimate_is_never_below_the_plans_and_grows_with_decodes(
    queued: int, decodes: int, in_flight: int, cached: int
) -> None:
    """Admission promises a TTFT: its estimate takes the running decodes and the
    sequence slots into account, so it is at least the plan's (which assumes the whole
    GPU for the queue), more with more decodes sharing the steps."""
    request = Request(1, np.arange(1, 41, dtype=np.uint64), 645, expected_output_tokens=128)

    def est(d: int) -> Estimate:
        w = WorkerView(
            3,
            queued_prefill_tokens=queued,
            running_decodes=d,
            in_flight=max(in_flight, d),
            mean_context_tokens=2_000,
            gpu_blocks=cached,
        )
        return loaded_estimate(request, View([w], 16, COST), w)

    w = WorkerView(3, queued_prefill_tokens=queued, running_decodes=decodes, gpu_blocks=cached)
    w.in_flight, w.mean_context_tokens = max(in_flight, decodes), 2_000
    _, plan_est = plan_and_estimate(request, View([w], 16, COST), w)
    mine = est(decodes)
    assert mine.ttft_s >= plan_est.ttft_s
    assert (mine.prefill_s, mine.transfer_s, mine.tbt_s) == (
        plan_est.prefill_s,
        plan_est.transfer_s,
        plan_est.tbt_s,
    )
    assert est(decodes + 50).ttft_s > mine.ttft_s


def test_no_bound_no_estimate_and_rejections_pass_through() -> None:
    view = View([WorkerView(0)], 16, COST)
    request = Request(1, np.arange(1, 5, dtype=np.uint64), 70)
    decision = Decision(worker=0, dp_rank=0)
    assert admit(request, view, decision, None) is decision
    assert admit(request, view, decision, SLO()) is decision
    rejected = Decision.reject("router says no")
    assert admit(request, view, rejected, SLO(ttft_s=1e-9)) is rejected


def test_effective_slo_takes_each_unset_bound_from_the_default() -> None:
    request = Request(1, np.arange(1, 3, dtype=np.uint64), 40)
    assert effective_slo(request, None) is None
    assert effective_slo(request, SLO(ttft_s=2.0)) == SLO(ttft_s=2.0)
    request.slo = SLO(tbt_s=0.1)
    assert effective_slo(request, None) == SLO(tbt_s=0.1)
    assert effective_slo(request, SLO(ttft_s=2.0, tbt_s=0.5)) == SLO(ttft_s=2.0, tbt_s=0.1)


@pytest.mark.parametrize("name", ROUTERS)
def test_every_router_takes_the_slo_options_by_name(name: str) -> None:
    r = create_router(name, ttft_slo_s=2, tbt_slo_s=0.25)
    assert default_slo(r) == SLO(ttft_s=2.0, tbt_s=0.25)
    assert default_slo(create_router(name, tbt_slo_s=0.25)) == SLO(tbt_s=0.25)
    assert default_slo(create_router(name)) is None


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "2", True, None])
def test_bad_slo_options_are_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match="ttft_slo_s"):
        create_router("mooncake", ttft_slo_s=value)


def test_a_router_that_cannot_hold_an_slo_is_a_config_error() -> None:
    from quillcache.routing import register_router
    from quillcache.routing.registry import RouterFactory

    class Slotted:
        """A duck-typed router (any factory registers) whose __slots__ has no room."""

        __slots__ = ()
        name = "test-slotted"

        def route(self, request: Request, view: View) -> Decision:
            return Decision(worker=view.worker_at(0).worker)

    register_router(Slotted.name, cast(RouterFactory, Slotted), replace=True)
    assert default_slo(create_router(Slotted.name)) is None
    with pytest.raises(ConfigError, match="cannot hold an SLO"):
        create_router(Slotted.name, ttft_slo_s=1.0)


def test_a_wrapped_routers_slo_applies() -> None:
    # the simulator's replicas route through a wrapper holding the router as `inner`
    class Wrapper(Router):
        name = "test-wrapper"

        def __init__(self, inner: Router) -> None:
            super().__init__()
            self.inner = inner

        def route(self, request: Request, view: View) -> Decision:
            return self.inner.route(request, view)

    inner = create_router("round-robin", ttft_slo_s=1e-6)
    assert default_slo(Wrapper(Wrapper(inner))) == SLO(ttft_s=1e-6)
    assert default_slo(Wrapper(create_router("round-robin"))) is None
    plane = ControlPlane(index="native", router=Wrapper(inner), block_size=BS)
    plane.add_worker(0, capacity_blocks=100, model=MODEL)
    assert plane.route(_request()).rejected
