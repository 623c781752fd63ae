"""A router's own shortlist for the booking step of several gateways
(`Router.shortlist`, `quillcache.routing.shortlist`), and its conversion to the state
layer's load units (`quillcache.state.shortlist.shortlist_of`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, prefill_pairs
from quillcache.identity import content_keys, namespace
from quillcache.routing import Request, Router, create_router
from quillcache.routing.shortlist import (
    Preference,
    ShortlistContractError,
    check_preferences,
    cost_preferences,
    reference_preferences,
)
from quillcache.routing.types import View, WorkerView
from quillcache.state import LoadWeights
from quillcache.state.shortlist import prefill_tokens, reference_shortlist_of, shortlist_of

BS = 16


def request(blocks: int = 8, own: int = 0) -> Request:
    tokens = list(range(1000, 1000 + blocks * BS)) + [7] * own
    keys = np.asarray(content_keys(tokens, BS, namespace("", "", "", "", BS)), dtype=np.uint64)
    return Request(0, keys, len(tokens), expected_output_tokens=16)


def view(*workers: WorkerView) -> View:
    return View(list(workers), BS, CostModel())


def reference(
    req: Request, v: View, scores: list[float], position: int, size: int
) -> list[tuple[int, float]]:
    """(row, requests) by the rule written out: the decision first, then the others by
    (score, row); 1 + lead over the best other row / the queue one request adds."""
    n = len(scores)
    rows = [position, *sorted((r for r in range(n) if r != position), key=lambda r: (scores[r], r))]
    out = []
    for r in rows[:size]:
        rival = min((scores[o] for o in range(n) if o != r), default=math.inf)
        held = min(v.workers[r].gpu_blocks, len(req.content_keys))
        new = max(req.prompt_tokens - held * BS, 1)
        # the request queued there: its uncached tokens, attending to the cached ones
        step = v.cost.queue_time(new, prefill_pairs(new, req.prompt_tokens - new))
        lead = max(rival - scores[r], 0.0) if math.isfinite(rival) else 0.0
        out.append((r, 1.0 + lead / step))
    return out


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 20_000)), min_size=1, max_size=9),
    st.integers(1, 5),
    st.data(),
)
def test_cost_preferences_follow_the_rule(
    rows: list[tuple[int, int]], size: int, data: st.DataObject
) -> None:
    v = view(
        *(WorkerView(i, queued_prefill_tokens=q, gpu_blocks=g) for i, (g, q) in enumerate(rows))
    )
    req = request()
    scores = [
        float(x)
        for x in data.draw(
            st.lists(st.sampled_from([0.1, 0.5, 0.9, 2.0]), min_size=len(rows), max_size=len(rows))
        )
    ]
    position = data.draw(st.integers(0, len(rows) - 1))
    got = cost_preferences(req, v, np.asarray(scores), position, size)
    check_preferences(got, len(rows), position, size)
    want = reference(req, v, scores, position, size)
    assert [p.position for p in got] == [r for r, _ in want]
    assert [p.requests for p in got] == pytest.approx([k for _, k in want])
    assert all(p.pending_requests == 0 for p in got)  # no held scores: no credit


def test_a_prefix_being_computed_earns_the_credit_the_held_scores_give() -> None:
    """Cold engines tie; with the prefix held, a row would stay preferred for as many
    requests as its lead then buys at the queue a request with the prefix held adds."""
    v = view(WorkerView(0), WorkerView(1), WorkerView(2))
    req = request(blocks=40, own=16)
    scores = np.asarray([1.0, 1.0, 1.0])
    held = np.asarray([0.2, 0.2, 0.2])
    got = cost_preferences(req, v, scores, 0, 3, scores_if_held=held)
    new = max(req.prompt_tokens - len(req.content_keys) * BS, 1)
    step_held = v.cost.queue_time(new, prefill_pairs(new, req.prompt_tokens - new))
    assert [p.requests for p in got] == [1.0, 1.0, 1.0]
    assert got[0].pending_requests == pytest.approx((1.0 - 0.2) / step_held)


def test_check_preferences_names_what_is_wrong() -> None:
    ok = [Preference(1, 1.0), Preference(0, 2.0)]
    check_preferences(ok, 2, 1, 2)
    bad = {
        "empty": ([], 2, 0, 2),
        "more than the size": (ok, 2, 1, 1),
        "not the decision's row": (ok, 2, 0, 2),
        "not a row of the view": ([Preference(1, 1.0), Preference(5, 1.0)], 2, 1, 2),
        "listed twice": ([Preference(1, 1.0), Preference(1, 1.0)], 2, 1, 2),
        "finite": ([Preference(1, math.nan)], 2, 1, 2),
        ">= 0": ([Preference(1, 1.0, -1.0)], 2, 1, 2),
    }
    for words, (prefs, rows, position, size) in bad.items():
        with pytest.raises(ShortlistContractError, match=words):
            check_preferences(prefs, rows, position, size)


def test_routers_without_a_trade_off_leave_the_shortlist_to_the_booking_step() -> None:
    v = view(WorkerView(0), WorkerView(1))
    req = request()
    for name in ("round-robin", "least-loaded", "session-affinity"):
        r = create_router(name)
        d = r.route(req, v)
        assert r.shortlist(req, v, v.position(d.worker or 0), 4) is None


@pytest.mark.parametrize("name", ["mooncake", "quillcache"])
def test_cost_routers_give_a_valid_shortlist_led_by_their_decision(name: str) -> None:
    v = view(
        WorkerView(0, queued_prefill_tokens=4000),
        WorkerView(1, gpu_blocks=6),
        WorkerView(2, queued_prefill_tokens=100),
        WorkerView(3, pending_blocks=8),
    )
    req = request(blocks=8, own=4)
    r: Router = create_router(name)
    d = r.route(req, v)
    at = v.position(d.worker or 0)
    prefs = r.shortlist(req, v, at, 3)
    assert prefs is not None
    check_preferences(prefs, len(v), at, 3)
    assert prefs[0].requests >= 1.0


def test_shortlist_of_turns_requests_into_load_units() -> None:
    """ceiling = the load seen + requests x one such request's load there; credit =
    pending requests x the load of one whose prefix is held (in_flight and queued
    tokens weighed)."""
    v = view(
        WorkerView(0, in_flight=2, queued_prefill_tokens=300),
        WorkerView(1, in_flight=1, gpu_blocks=4),
    )
    req = request(blocks=8, own=4)
    w = LoadWeights(in_flight=1.0, queued_tokens=0.01)
    s = shortlist_of(v, [Preference(1, 3.0, 2.0), Preference(0, 1.0)], 9, req.prompt_tokens, BS, w)
    unit1 = 1.0 + 0.01 * prefill_tokens(req.prompt_tokens, 4, BS)
    held_unit = 1.0 + 0.01 * prefill_tokens(req.prompt_tokens, 9, BS)
    assert [c.engine.engine for c in s.candidates] == [1, 0]
    assert s.candidates[0].ceiling == pytest.approx(1.0 + 3.0 * unit1)
    assert s.candidates[0].credit == pytest.approx(2.0 * held_unit)
    assert s.candidates[1].ceiling == pytest.approx(2.0 + 3.0 + 1.0 + 0.01 * req.prompt_tokens)
    assert s.cached_blocks == [4, 0]


# few values, so that scores and prefixes often tie
_SCORES = st.sampled_from([0.0, 0.1, 0.5, 0.9, 2.0, math.inf])


@st.composite
def shortlist_cases(draw: st.DrawFn) -> tuple[Request, View, np.ndarray, np.ndarray | None, int]:
    """A view (up to 80 rows: both sides of the small-view bound of the state layer)
    whose columns draw from few values, its scores, maybe held scores, a position."""
    n = draw(st.integers(1, 80))
    blocks = draw(st.integers(1, 12))
    cells = st.tuples(
        st.integers(0, 3),  # in flight
        st.sampled_from([0, 100, 4000]),  # queued prefill tokens
        st.integers(0, 2),  # running decodes
        st.integers(0, blocks + 2),  # gpu
        st.integers(0, blocks),  # cpu
        st.integers(0, 2),  # disk
        st.integers(0, blocks + 2),  # pending
        st.integers(0, 1),  # dp rank
    )
    rows = draw(st.lists(cells, min_size=n, max_size=n))
    v = view(
        *(
            WorkerView(1000 + i, in_flight=f, queued_prefill_tokens=q, running_decodes=d,
                       gpu_blocks=g, cpu_blocks=c, disk_blocks=k, pending_blocks=p, dp_rank=r)
            for i, (f, q, d, g, c, k, p, r) in enumerate(rows)
        )
    )  # fmt: skip
    v = View(None, BS, CostModel(), columns=v.columns)
    scores = np.asarray(draw(st.lists(_SCORES, min_size=n, max_size=n)), dtype=np.float64)
    held = draw(st.one_of(st.none(), st.lists(_SCORES, min_size=n, max_size=n).map(np.asarray)))
    return (
        request(blocks=blocks, own=draw(st.integers(0, 20))),
        v,
        scores,
        held,
        draw(st.integers(0, n - 1)),
    )


@settings(max_examples=300, deadline=None)
@given(case=shortlist_cases(), size=st.integers(0, 6))
def test_the_native_shortlist_is_the_reference_bit_for_bit(
    case: tuple[Request, View, np.ndarray, np.ndarray | None, int], size: int
) -> None:
    """`cost_preferences` and `shortlist_of` (the native kernel's) against
    `reference_preferences` and `reference_shortlist_of` (numpy): the same rows in the
    same order, the same counts, ceilings, credits and blocks, exactly."""
    req, v, scores, held, position = case
    got = cost_preferences(req, v, scores, position, size, scores_if_held=held)
    want = reference_preferences(req, v, scores, position, size, scores_if_held=held)
    assert got == want
    for weights in (LoadWeights(), LoadWeights(1.0, 0.01, 0.5)):
        args = (v, want, len(req.content_keys), req.prompt_tokens, BS, weights)
        assert shortlist_of(*args) == reference_shortlist_of(*args)


def test_a_nan_score_is_ordered_by_the_reference() -> None:
    v = view(WorkerView(0), WorkerView(1), WorkerView(2))
    scores = np.asarray([math.nan, 0.5, 0.1])
    got = cost_preferences(request(), v, scores, 1, 3)
    assert got == reference_preferences(request(), v, scores, 1, 3)
    assert [p.position for p in got] == [1, 2]  # a NaN row is never preferred


def test_native_shortlist_arguments_are_checked() -> None:
    v = view(WorkerView(0), WorkerView(1))
    kernel = v.cost.kernel
    c = v.columns
    with pytest.raises(ValueError, match="position 2"):
        kernel.cost_preferences(np.zeros(2), None, c.gpu_blocks, c.pending_blocks, 2, 2, 16, 1, BS)
    with pytest.raises(ValueError, match="disagree"):
        kernel.cost_preferences(np.zeros(3), None, c.gpu_blocks, c.pending_blocks, 0, 2, 16, 1, BS)
    with pytest.raises(ValueError, match="position 5"):
        shortlist_of(v, [Preference(5, 1.0)], 1, 16, BS, LoadWeights())
