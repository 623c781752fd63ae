"""Each built-in policy behaves as its source describes (docs/routing.md)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane.admission import admit, loaded_estimate
from quillcache.costmodel import CostModel, CostModelConfig, prefill_pairs
from quillcache.errors import ConfigError
from quillcache.routing import (
    SLO,
    Action,
    QuillCacheRouter,
    Request,
    View,
    WorkerView,
    create_router,
    default_slo,
    plan_and_estimate,
)
from quillcache.routing.base import estimate_ttft_s
from tests.routing.strategies import BLOCK, COST, request_and_view


def _req(blocks: int, extra: int = 3, rid: int = 0, session: str | None = None) -> Request:
    keys = np.arange(1, blocks + 1, dtype=np.uint64)
    return Request(rid, keys, blocks * BLOCK + extra, session_id=session)


def _view(*workers: WorkerView, cost: CostModel = COST) -> View:
    return View(workers=list(workers), block_size=BLOCK, cost=cost)


@settings(max_examples=80)
@given(rv=request_and_view())
def test_fast_ttft_estimate_agrees_with_the_plan(rv: tuple[Request, View]) -> None:
    request, view = rv
    for w in view.workers:
        _, est = plan_and_estimate(request, view, w)
        assert math.isclose(estimate_ttft_s(request, view, w), est.ttft_s, rel_tol=1e-12)


def test_plan_reuses_gpu_fetches_cpu_recomputes_rest() -> None:
    w = WorkerView(0, gpu_blocks=3, cpu_blocks=7)
    plan, est = plan_and_estimate(_req(10), _view(w), w)
    assert [(s.action, s.start, s.end, s.source) for s in plan] == [
        (Action.REUSE, 0, 3, ""),
        (Action.FETCH_TIER, 3, 7, "cpu"),
        (Action.RECOMPUTE, 7, 10, ""),
    ]
    assert est.transfer_s == pytest.approx(COST.transfer_time(4, "cpu"))


def test_peer_fetch_only_when_allowed() -> None:
    allowed = CostModel(CostModelConfig.parse({"transfer": {"allow_peer_fetch": True}}))
    a, b = WorkerView(0), WorkerView(1, gpu_blocks=200)
    req = _req(200)
    plan, _ = plan_and_estimate(req, _view(a, b), a)
    assert [s.action for s in plan] == [Action.RECOMPUTE]
    plan, _ = plan_and_estimate(req, _view(a, b, cost=allowed), a)
    assert plan[0].action == Action.FETCH_PEER and plan[0].source == "worker:1"


def test_round_robin_cycles_in_id_order() -> None:
    r = create_router("round-robin")
    v = _view(WorkerView(3), WorkerView(5), WorkerView(9))
    assert [r.route(_req(1), v).worker for _ in range(7)] == [3, 5, 9, 3, 5, 9, 3]


def test_least_loaded_and_power_of_two_avoid_the_busy_worker() -> None:
    v = _view(WorkerView(0, in_flight=9), WorkerView(1, in_flight=2), WorkerView(2, in_flight=5))
    assert create_router("least-loaded").route(_req(1), v).worker == 1
    p2 = create_router("power-of-two", seed=3)
    chosen = {p2.route(_req(1), v).worker for _ in range(50)}
    assert 0 not in chosen  # the busiest can never win a pair


def test_session_affinity_is_consistent_hashing() -> None:
    r = create_router("session-affinity")
    full = _view(*(WorkerView(w) for w in range(8)))
    sessions = [f"s{i}" for i in range(400)]
    before = {s: r.route(_req(1, session=s), full).worker for s in sessions}
    assert len(set(before.values())) == 8
    shrunk = _view(*(WorkerView(w) for w in range(8) if w != 3))
    after = {s: r.route(_req(1, session=s), shrunk).worker for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    # only the sessions of the removed worker move
    assert moved and all(before[s] == 3 for s in moved)


def test_dynamo_cost_formula() -> None:
    # Dynamo: prefill_load_scale * max((queued + prompt)/bs - overlap credit, 0)
    #         + active blocks + the request's blocks not already there
    r = create_router("dynamo")
    req = _req(20, extra=0)  # 20 request blocks, 320 tokens
    a = WorkerView(
        0, gpu_blocks=15, queued_prefill_tokens=10 * BLOCK, kv_usage=0.5, capacity_blocks=100
    )  # max(10 + 20 - 15, 0) + 50 + 5 = 70
    b = WorkerView(
        1, gpu_blocks=0, queued_prefill_tokens=0, kv_usage=0.25, capacity_blocks=100
    )  # 20 + 25 + 20 = 65
    assert r.route(req, _view(a, b)).worker == 1
    # prefill_load_scale 3 weighs prefill more: a = 45 + 55 = 100, b = 60 + 45 = 105
    assert create_router("dynamo", prefill_load_scale=3.0).route(req, _view(a, b)).worker == 0
    b.kv_usage = 0.6  # 20 + 60 + 20 = 100 > 70
    assert r.route(req, _view(a, b)).worker == 0


def test_sglang_thresholds() -> None:
    r = create_router("sglang")
    hot = WorkerView(0, gpu_blocks=8, in_flight=10, resident_blocks=500)
    cold = WorkerView(1, gpu_blocks=0, in_flight=0, resident_blocks=10)
    # match rate 8*16/(10*16+3) = 0.79 > 0.3 and balanced: cache wins
    assert r.route(_req(10), _view(hot, cold)).worker == 0
    # match 2 blocks of 10 = 0.2 < 0.3: smallest tree
    hot.gpu_blocks = 2
    assert r.route(_req(10), _view(hot, cold)).worker == 1
    # imbalance needs BOTH > 64 absolute and > 1.5x relative
    hot.gpu_blocks = 8
    hot.in_flight, cold.in_flight = 100, 30  # diff 70 > 64, 100 > 45
    assert r.route(_req(10), _view(hot, cold)).worker == 1
    hot.in_flight, cold.in_flight = 160, 100  # diff 60: balanced
    assert r.route(_req(10), _view(hot, cold)).worker == 0
    hot.in_flight, cold.in_flight = 170, 120  # diff 70 but 170 < 180
    assert r.route(_req(10), _view(hot, cold)).worker == 0


def test_sglang_knows_a_routed_prompt_before_the_engine_reports_it() -> None:
    # SGLang's tree inserts a prompt's text when it routes it: the next request with
    # the same prefix follows it there, before any BlockStored (pending_blocks)
    r = create_router("sglang")
    routed = WorkerView(0, pending_blocks=8, in_flight=1, resident_blocks=50)
    other = WorkerView(1, resident_blocks=10)
    d = r.route(_req(10), _view(routed, other))
    assert d.worker == 0 and d.reason == "match rate 0.79"
    routed.pending_blocks = 2  # 0.2 < 0.3: the smallest tree again
    assert r.route(_req(10), _view(routed, other)).worker == 1


def test_llmd_tier_weights() -> None:
    r = create_router("llm-d", queue_weight=0.0, kv_weight=0.0)
    gpu = WorkerView(0, gpu_blocks=5)
    cpu = WorkerView(1, cpu_blocks=6)  # 6 * 0.8 = 4.8 < 5
    assert r.route(_req(10), _view(gpu, cpu)).worker == 0
    cpu.cpu_blocks = 7  # 5.6 > 5
    assert r.route(_req(10), _view(gpu, cpu)).worker == 1


def test_llmd_weights_and_prefix_normalisation_are_llmds() -> None:
    from quillcache.routing import LlmdPrecisePrefix
    from quillcache.routing.llmd import normalised_hits

    r = create_router("llm-d")
    assert isinstance(r, LlmdPrecisePrefix) and r.weights == (2.0, 1.0, 1.0)
    # min-max among the workers with a hit, 0 without, 1 when the hits are equal
    assert normalised_hits(np.array([0.0, 2.0, 6.0, 4.0])).tolist() == [0.0, 0.0, 1.0, 0.5]
    assert normalised_hits(np.array([0.0, 3.0, 3.0])).tolist() == [0.0, 1.0, 1.0]
    assert normalised_hits(np.array([0.0, 0.0])).tolist() == [0.0, 0.0]
    # a short prefix on one worker scores the full prefix weight when no one holds
    # more (2 + queue 0 + kv 0.2 = 2.2 against 0 + 1 + 1 = 2): llm-d's relative score
    short = WorkerView(0, gpu_blocks=1, in_flight=5, kv_usage=0.8)
    idle = WorkerView(1)
    assert r.route(_req(40), _view(short, idle)).worker == 0
    short.kv_usage = 0.9  # 2.1 > 2
    assert r.route(_req(40), _view(short, idle)).worker == 0
    idle.kv_usage = 0.0
    short.kv_usage = 1.0  # 2.0, and idle 0 + 1 + 1 = 2.0: a tie, drawn at random
    assert {
        create_router("llm-d", seed=s).route(_req(40), _view(short, idle)).worker for s in range(40)
    } == {0, 1}


def test_preble_exploits_long_matches_and_explores_otherwise() -> None:
    r = create_router("preble")
    cached = WorkerView(0, gpu_blocks=6, queued_prefill_tokens=50_000)
    idle = WorkerView(1)
    d = r.route(_req(10), _view(cached, idle))  # 96 cached > 67 missing: exploit
    assert d.worker == 0 and d.reason == "exploit"
    cached.gpu_blocks = 3  # 48 < 115: explore -> the idle one
    d = r.route(_req(10), _view(cached, idle))
    assert d.worker == 1 and d.reason == "explore"


@given(slo=st.floats(0.001, 5.0))
@settings(max_examples=30)
def test_mooncake_rejects_exactly_when_the_best_estimate_misses_the_slo(slo: float) -> None:
    # Mooncake's early rejection, now the control plane's admission stage after its
    # argmin: the router picks the least estimate, admission prices that engine's queue
    # as batching makes it (never below the router's figure) and rejects exactly when
    # that misses the SLO
    r = create_router("mooncake", ttft_slo_s=slo)
    pairs = prefill_pairs(4_000, 0)  # queues of 4,000-token prompts
    v = _view(
        WorkerView(0, queued_prefill_tokens=40_000, queued_prefill_pairs=10 * pairs),
        WorkerView(1, queued_prefill_tokens=8_000, queued_prefill_pairs=2 * pairs),
    )
    req = _req(100)
    best = min(estimate_ttft_s(req, v, w) for w in v.workers)
    chosen = r.route(req, v)
    assert not chosen.rejected  # the router itself only chooses
    assert chosen.worker == 1 and estimate_ttft_s(req, v, v.by_id(1)) == best
    loaded = loaded_estimate(req, v, v.by_id(1))
    assert loaded.ttft_s >= best
    d = admit(req, v, chosen, default_slo(r))
    assert d.rejected == (loaded.ttft_s > slo)
    if d.rejected:
        assert "SLO" in d.reason and d.estimate == loaded
    # a request's own SLO takes precedence
    req.slo = SLO(ttft_s=loaded.ttft_s * 2)
    assert not admit(req, v, r.route(req, v), default_slo(r)).rejected


def test_ttft_routers_trade_cache_against_queue() -> None:
    req = _req(400)
    for name in ("mooncake", "quillcache"):
        r = create_router(name)
        cached = WorkerView(0, gpu_blocks=380, queued_prefill_tokens=2_000)
        idle = WorkerView(1)
        assert r.route(req, _view(cached, idle)).worker == 0
        cached.queued_prefill_tokens = 400_000  # far longer than recomputing
        assert r.route(req, _view(cached, idle)).worker == 1


def test_quillcache_counts_prefixes_being_computed() -> None:
    req = _req(400)
    computing = WorkerView(0, pending_blocks=390, queued_prefill_tokens=2_000)
    idle = WorkerView(1)
    assert create_router("quillcache").route(req, _view(computing, idle)).worker == 0
    assert create_router("mooncake").route(req, _view(computing, idle)).worker == 1


def test_quillcache_prices_the_work_it_adds_under_load() -> None:
    req = _req(160)  # 2,563 tokens, 150 blocks cached on worker 0
    cached = WorkerView(0, gpu_blocks=150, in_flight=6, queued_prefill_tokens=4_000)
    idle = WorkerView(1, in_flight=4, queued_prefill_tokens=1_400)
    view = _view(cached, idle)
    greedy = create_router("mooncake").route(req, view).worker
    quill = create_router("quillcache", interference=False).route(req, view).worker
    assert (greedy, quill) == (1, 0)
    # with the work term off it is the greedy router again
    plain = create_router("quillcache", interference=False, work_weight=0.0)
    assert plain.route(req, view).worker == 1


def test_quillcache_does_not_pile_decodes_onto_one_worker() -> None:
    req = _req(60)
    req.expected_output_tokens = 200
    # worker 0 holds the prefix but decodes 150 sequences; the others are idle
    busy = WorkerView(
        0, gpu_blocks=55, in_flight=150, running_decodes=150, mean_context_tokens=2_000
    )
    idle = [WorkerView(w) for w in (1, 2, 3)]
    view = _view(busy, *idle)
    assert create_router("mooncake").route(req, view).worker == 0
    assert create_router("quillcache").route(req, view).worker != 0
    assert create_router("quillcache", decode_weight=0.0).route(req, view).worker == 0


def test_quillcache_scores_peer_fetches_when_allowed() -> None:
    from quillcache.routing.quill import QuillCacheRouter

    allowed = CostModel(CostModelConfig.parse({"transfer": {"allow_peer_fetch": True}}))
    req = _req(300)
    holder, other = WorkerView(0, gpu_blocks=290), WorkerView(1)
    r = QuillCacheRouter(work_weight=0.0, decode_weight=0.0)
    local = r.estimate_s(req, _view(holder, other), other)
    fetched = r.estimate_s(req, _view(holder, other, cost=allowed), other)
    assert fetched < local / 5  # 290 blocks move much faster than they recompute
    plan, est = plan_and_estimate(req, _view(holder, other, cost=allowed), other)
    assert plan[0].action == Action.FETCH_PEER
    assert fetched == pytest.approx(est.ttft_s)


def test_quillcache_order_only_makes_the_cache_choice() -> None:
    req = _req(400)  # 6,403 tokens; worker 0 holds 380 blocks (6,080 tokens)
    cached = WorkerView(0, gpu_blocks=380, in_flight=4, queued_prefill_tokens=200_000)
    idle = WorkerView(1)
    timed = _view(cached, idle)
    order_only = View(workers=[cached, idle], block_size=BLOCK, cost=COST, order_only=True)
    r = create_router("quillcache")
    # timed: 200k queued tokens outweigh recomputing the prefix
    assert r.route(req, timed).worker == 1
    # order-only: the load is a proxy, reuse wins unless the pressure outweighs it
    assert r.route(req, order_only).worker == 0
    assert create_router("quillcache", pressure_weight=0.05).route(req, order_only).worker == 1
    # nothing cached anywhere: the least recently pressed cache
    fresh = [WorkerView(w, queued_prefill_tokens=q) for w, q in ((0, 9_000), (1, 500), (2, 4_000))]
    view = View(workers=fresh, block_size=BLOCK, cost=COST, order_only=True)
    assert r.route(_req(10), view).worker == 1


def _decoding(worker: int, decodes: int, **kw: int) -> WorkerView:
    return WorkerView(
        worker, in_flight=decodes, running_decodes=decodes, mean_context_tokens=2_000, **kw
    )


def test_quillcache_keeps_a_continuing_session_at_its_home() -> None:
    # worker 0 holds the prefix but decodes far above the mean (see the pile-up test)
    busy = (_decoding(0, 150, gpu_blocks=55), *(WorkerView(w) for w in (1, 2, 3)))
    view = View(workers=list(busy), block_size=BLOCK, cost=COST, now_s=30.0)  # a turn later
    req = _req(60, session="chat-1")
    req.expected_output_tokens = 200
    r = create_router("quillcache")
    home = _view(*(WorkerView(w) for w in range(4)))
    r.route(_req(60, session="chat-1"), home)  # first turn: chat-1 is homed on worker 0
    assert r.route(req, view).worker == 0  # a later turn stays with its history
    # without session tracking the same turn is moved off the busy worker
    assert create_router("quillcache", sessions=False).route(req, view).worker != 0


def test_quillcache_homes_new_sessions_where_few_sessions_live() -> None:
    r = create_router("quillcache")
    plain = create_router("quillcache", sessions=False)
    busy_1 = _view(WorkerView(0), _decoding(1, 100))
    for s in range(4):  # four sessions homed on worker 0 (worker 1 is busy then)
        assert r.route(_req(20, rid=s, session=f"s{s}"), busy_1).worker == 0
    equal = _view(_decoding(0, 10), _decoding(1, 10))
    new = _req(20, rid=9, session="s9")
    new.expected_output_tokens = 300
    # the same load now, but worker 0's sessions will keep coming back
    assert r.route(new, equal).worker == 1
    assert plain.route(new, equal).worker == 0  # a tie: the lower id
    # once those sessions are idle longer than the TTL they no longer count
    later = View(workers=equal.workers, block_size=BLOCK, cost=COST, now_s=1_000.0)
    new2 = _req(20, rid=10, session="s10")
    new2.expected_output_tokens = 300
    fresh = create_router("quillcache", session_ttl_s=10.0)
    for s in range(4):
        fresh.route(_req(20, rid=s, session=f"s{s}"), busy_1)
    assert fresh.route(new2, later).worker == 0


def test_quillcache_prices_a_home_whose_sessions_are_not_decoding_yet() -> None:
    """A new session's home term counts the sessions homed on an engine even while
    none of them decodes (their prefills queued there, or between turns): at the
    fleet's decode context, not the engine's own (zero when nothing decodes), or the
    engine that looks idle in decode collects every new session's prefill."""
    r = create_router("quillcache")
    assert isinstance(r, QuillCacheRouter)
    queued = WorkerView(0, in_flight=3, queued_prefill_tokens=12_000)  # 3 sessions' prefills
    decoding = _decoding(1, 10)  # 3 sessions decoding
    idle = WorkerView(2)  # no session homed
    view = _view(queued, decoding, idle)
    r._live = {0: 3, 1: 3}
    new = _req(20, rid=9, session="s9")
    new.expected_output_tokens = 300
    r._session_load("s9", view)
    with_homes = r.estimates(new, view)
    r._session_kv_tokens = {}
    without = r.estimates(new, view)
    term = (with_homes - without).tolist()
    assert term[0] > 0 and term[0] == pytest.approx(term[1], rel=1e-12)
    assert term[2] == 0


def test_quillcache_balances_a_sessions_concurrent_requests_like_lone_ones() -> None:
    """A session's next turn stays home however many decodes run there (its home was
    chosen for them); a request routed just after the session's previous one runs
    beside it, and goes where its decodes do not pile up, as a lone request would."""
    decoding = _decoding(0, 40)  # the session's home: no queue, 40 decodes
    queued = WorkerView(1, in_flight=2, queued_prefill_tokens=3_000)

    def routed_at(now_s: float) -> int:
        r = create_router("quillcache")
        assert isinstance(r, QuillCacheRouter)
        r._homes["s"] = (0, 100.0)  # the session's previous request, routed at 100 s
        r._live = {0: 1}
        view = View(workers=[decoding, queued], block_size=BLOCK, cost=COST, now_s=now_s)
        req = Request(0, np.arange(1, 126, dtype=np.uint64), 2_000, session_id="s")
        req.expected_output_tokens = 200
        return r.route(req, view).worker

    assert routed_at(110.0) == 0  # a turn: stays home
    assert routed_at(100.05) == 1  # beside the previous one: balanced
    lone = Request(0, np.arange(1, 126, dtype=np.uint64), 2_000, expected_output_tokens=200)
    assert create_router("quillcache").route(lone, _view(decoding, queued)).worker == 1


def test_quillcache_places_new_blocks_where_they_evict_nothing() -> None:
    """Every request shares a first block (the Mooncake trace's): an idle engine that
    has never served one lacks it. Scored on this request's time alone the full engine
    holding it wins by that block, and fills again while the empty one stays unused;
    the blocks placed beyond the free ones are evicted cached blocks, and at a weight
    of 0.25 their recompute outweighs one block of prefill."""
    full = WorkerView(0, gpu_blocks=1, capacity_blocks=1_000, resident_blocks=1_000)
    empty = WorkerView(1, capacity_blocks=1_000)
    req = _req(24)
    evicting = {"evict_weight": 0.25}
    assert create_router("quillcache", **evicting).route(req, _view(full, empty)).worker == 1
    assert create_router("quillcache").route(req, _view(full, empty)).worker == 0  # off
    # with room on both, nothing is evicted anywhere: the held block wins
    roomy = WorkerView(0, gpu_blocks=1, capacity_blocks=1_000, resident_blocks=10)
    assert create_router("quillcache", **evicting).route(req, _view(roomy, empty)).worker == 0
    # capacity or residency not known: no eviction is priced
    for unknown in (
        WorkerView(0, gpu_blocks=1, capacity_blocks=0, resident_blocks=1_000),
        WorkerView(
            0, gpu_blocks=1, capacity_blocks=1_000, resident_blocks=1_000, residency_known=False
        ),
    ):
        assert create_router("quillcache", **evicting).route(req, _view(unknown, empty)).worker == 0
    with pytest.raises(ConfigError, match="evict_weight"):
        create_router("quillcache", evict_weight=-1.0)


def test_quillcache_pile_up_counts_only_decodes_still_running_after_the_prefill() -> None:
    decoding = _decoding(0, 40)  # no queue, but 40 decodes above the others
    queued = WorkerView(1, in_flight=2, queued_prefill_tokens=3_000)
    view = _view(decoding, queued)
    r = create_router("quillcache")
    short = Request(0, np.arange(1, 126, dtype=np.uint64), 2_000, expected_output_tokens=200)
    # a short prompt would decode alongside those 40: queue behind 3,000 tokens instead
    assert r.route(short, view).worker == 1
    assert create_router("quillcache", decode_weight=0.0).route(short, view).worker == 0
    # a 50k-token prompt starts decoding after theirs are done: no pile-up to avoid
    long = Request(1, np.arange(1, 3126, dtype=np.uint64), 50_000, expected_output_tokens=200)
    assert r.route(long, view).worker == 0


def test_quillcache_continuing_work_weight_lets_a_session_leave_a_queue() -> None:
    # worker 0 holds the session's history but has 1.5x its recompute queued: the
    # default keeps it home (the recompute elsewhere also delays others), a weight of
    # 0 moves it as soon as the queue outweighs the recompute (pure TTFT argmin)
    queued = 90 * BLOCK
    busy_home = WorkerView(0, gpu_blocks=58, queued_prefill_tokens=queued, in_flight=1)
    others = (WorkerView(w) for w in (1, 2, 3))
    view = View(workers=[busy_home, *others], block_size=BLOCK, cost=COST, now_s=30.0)
    idle = _view(*(WorkerView(w) for w in range(4)))
    for weight, expect_home in ((1.0, True), (0.0, False)):
        r = create_router("quillcache", continuing_work_weight=weight)
        assert r.route(_req(58, session="chat-1"), idle).worker == 0  # homed on 0
        moved = r.route(_req(60, session="chat-1"), view).worker
        assert (moved == 0) is expect_home, weight
