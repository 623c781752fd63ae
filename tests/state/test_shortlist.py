"""The booking step's inputs, built from a router's view: the shortlist and its ceilings
(`quillcache.state.shortlist`), and the plane's view of the fleet's booked load
(`quillcache.state.load_store`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane.load import DECODES, IN_FLIGHT, MEAN_CONTEXT, PAIRS, QUEUED
from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.routing.types import View, WorkerView
from quillcache.state import EngineKey, LoadWeights, SharedLoad
from quillcache.state import shortlist as shortlist_module
from quillcache.state.load_store import SharedLoadStore
from quillcache.state.shortlist import ShortlistPolicy, anchors, build_shortlist, prefill_tokens
from quillcache.state.types import TAIL_FP_CHARS, TAIL_MAX_BLOCKS

# the attention pairs of 100 new tokens after 200 cached ones, by hand
P100 = 100 * (200 + 50.5)


def view(*workers: WorkerView) -> View:
    return View(list(workers), 16, CostModel())


def test_the_choice_first_then_longest_prefix_then_least_loaded() -> None:
    v = view(
        WorkerView(0, in_flight=1),
        WorkerView(1, in_flight=5, gpu_blocks=8),
        WorkerView(2, in_flight=0),
        WorkerView(3, in_flight=2, pending_blocks=4),
        WorkerView(4, in_flight=9),
    )
    s = build_shortlist(v, 4, 0, 8, ShortlistPolicy(size=4, cache_slack=4.0))
    assert [c.engine.engine for c in s.candidates] == [4, 1, 3, 2]
    assert s.cached_blocks == [0, 8, 4, 0]
    # ceiling: what the replica saw + 1, + the slack in proportion to the prefix held
    assert [c.ceiling for c in s.candidates] == [10.0, 10.0, 5.0, 1.0]


def test_another_candidate_is_preferred_only_below_the_choices_load() -> None:
    """A round-robin-like choice that was not the least loaded: the others' ceilings
    start from the choice's load, so a booking moves only to a less loaded engine."""
    v = view(WorkerView(0, in_flight=6), WorkerView(1, in_flight=2), WorkerView(2, in_flight=9))
    s = build_shortlist(v, 0, 0, 8, ShortlistPolicy(size=3, cache_slack=0.0))
    assert [(c.engine.engine, c.ceiling) for c in s.candidates] == [(0, 7.0), (1, 3.0), (2, 7.0)]


def test_a_choice_outside_the_view_is_still_first_and_never_too_loaded() -> None:
    s = build_shortlist(view(WorkerView(0), WorkerView(1)), 7, 1, 4, ShortlistPolicy(size=2))
    assert s.candidates[0].engine == EngineKey(7, 1) and math.isinf(s.candidates[0].ceiling)
    assert len(s.candidates) == 2


def test_policy_and_helpers() -> None:
    with pytest.raises(ConfigError):
        ShortlistPolicy(size=0)
    with pytest.raises(ConfigError):
        ShortlistPolicy(cache_slack=-1)
    keys = np.arange(10, 20, dtype=np.uint64)  # 10 blocks
    got = anchors(keys)
    assert [(a.key, a.blocks) for a in got] == [(10, 1), (11, 2), (13, 4), (17, 8), (19, 10)]
    # each tail: the fingerprints of the blocks up to the next anchor
    assert [a.tail for a in got] == ["000b", "000c000d", "000e000f00100011", "00120013", ""]
    assert anchors(keys[:0]) == []
    # a tail is cut at TAIL_MAX_BLOCKS fingerprints, each the key's low bits
    long = np.arange(1, 1001, dtype=np.uint64) * np.uint64(0x10001)
    tails = {a.blocks: a.tail for a in anchors(long)}
    assert len(tails[512]) == TAIL_MAX_BLOCKS * TAIL_FP_CHARS
    assert tails[512][:TAIL_FP_CHARS] == f"{(513 * 0x10001) & 0xFFFF:04x}"
    assert len(tails[256]) == TAIL_MAX_BLOCKS * TAIL_FP_CHARS
    assert len(tails[64]) == 64 * TAIL_FP_CHARS
    assert prefill_tokens(100, 3, 16) == 52 and prefill_tokens(10, 3, 16) == 1


def test_the_store_keeps_the_engines_gauges_above_the_booked_load() -> None:
    store = SharedLoadStore(rows=1)
    rows = {EngineKey(5, 0): 0, EngineKey(5, 1): 1}
    store.bind(rows.get)
    for r in (0, 1):
        store.add(r)
    store.own_booked(EngineKey(5, 0), 100, 300)  # 100 new tokens of a 300-token prompt
    assert store.value(0, IN_FLIGHT) == 1 and store.value(0, QUEUED) == 100
    assert store.value(0, PAIRS) == P100  # attention pairs move with the tokens
    store.report(0, {IN_FLIGHT: 3.0})  # the scrape merge put the engine's count on top
    store.apply_snapshot({EngineKey(5, 0): SharedLoad(4, 400, 0, 0, 4 * P100)})  # the fleet's
    assert store.value(0, IN_FLIGHT) == 6  # moved by the booked difference (1 -> 4)
    assert store.value(0, PAIRS) == 4 * P100
    assert store.booked(EngineKey(5, 0)) == SharedLoad(4, 400, 0, 0, 4 * P100)
    store.own_prefilled(EngineKey(5, 0), 100, 300)
    assert store.value(0, DECODES) == 1 and store.value(0, MEAN_CONTEXT) == 300
    assert store.value(0, PAIRS) == 3 * P100
    store.own_released(EngineKey(5, 0), 100, 300, prefilled=True)
    assert store.booked(EngineKey(5, 0)) == SharedLoad(3, 300, 0, 0, 3 * P100)
    store.apply_snapshot({})  # the fleet holds nothing: back to the engine's part
    assert store.value(0, IN_FLIGHT) == 2 and store.value(0, QUEUED) == 0
    assert store.value(0, PAIRS) == 0
    store.own_booked(EngineKey(9, 0), 1, 1)  # an engine this replica does not know: ignored
    store.book(1, 50, 50)  # the plane's own calls are ignored: the booking step books
    assert store.value(1, IN_FLIGHT) == 0


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 3),  # in flight
            st.integers(0, 2),  # queued tokens (x100)
            st.integers(0, 2),  # gpu blocks
            st.integers(0, 2),  # pending blocks
        ),
        min_size=1,
        max_size=12,
    ),
    choice=st.integers(0, 15),
    size=st.integers(1, 6),
    weights=st.sampled_from([LoadWeights(), LoadWeights(1.0, 0.01, 0.5)]),
)
def test_small_views_and_numpy_views_give_the_same_shortlist(
    rows: list[tuple[int, int, int, int]], choice: int, size: int, weights: LoadWeights
) -> None:
    """Views up to `SMALL_VIEW` rows are shortlisted from Python lists, larger ones with
    numpy: the same candidates, ceilings and blocks, in the same order, ties included
    (many rows here share a load and a prefix), and both as the rule says: the choice,
    then by (load less the top load per cached block, view order)."""
    v = view(
        *(
            WorkerView(i, in_flight=n, queued_prefill_tokens=100 * q, gpu_blocks=g,
                       pending_blocks=p)
            for i, (n, q, g, p) in enumerate(rows)
        )
    )  # fmt: skip
    policy = ShortlistPolicy(size=size, cache_slack=2.0, weights=weights)
    small = build_shortlist(v, choice, 0, 2, policy)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shortlist_module, "SMALL_VIEW", -1)
        large = build_shortlist(v, choice, 0, 2, policy)
    assert small == large
    score = [weights.score(SharedLoad(n, 100 * q, 0)) for n, q, _, _ in rows]
    cached = [max(g, p) for _, _, g, p in rows]
    top = max(score) + 1.0
    others = sorted((score[i] - cached[i] * top, i) for i in range(len(rows)) if i != choice)
    want = [i for _, i in others[: size - 1]]
    assert [c.engine.engine for c in small.candidates] == [choice, *want]


class _AlwaysMoves(SharedLoadStore):
    """The reference: `apply_some` moving every row it names, as it did before it
    skipped the rows that would not move."""

    def apply_some(self, loads: Iterable[tuple[EngineKey, SharedLoad]]) -> None:
        for key, ld in loads:
            row = self._row_of(key)
            if row is not None and row < len(self._booked):
                self._move_row(
                    row, ld.in_flight, ld.queued_prefill_tokens, ld.running_decodes,
                    ld.context_tokens, ld.queued_prefill_pairs,
                )  # fmt: skip


# few values, so that replies often repeat what a store holds
_LOADS = st.sampled_from(
    [
        SharedLoad(),
        SharedLoad(1, 100, 0, 0, P100),
        SharedLoad(1, 0, 1, 300),
        SharedLoad(2, 100, 1, 300, P100),
    ]
)
_KEYS = st.sampled_from([EngineKey(5, 0), EngineKey(5, 1), EngineKey(7, 0)])
_OPS = st.one_of(
    st.tuples(st.just("some"), st.lists(st.tuples(_KEYS, _LOADS), max_size=3)),
    st.tuples(st.just("snapshot"), st.dictionaries(_KEYS, _LOADS, max_size=3)),
    st.tuples(st.just("booked"), _KEYS, st.just(100), st.just(300)),
    st.tuples(st.just("prefilled"), _KEYS, st.just(100), st.just(300)),
    st.tuples(st.just("released"), _KEYS, st.just(100), st.just(300), st.booleans()),
    st.tuples(
        st.just("report"),
        st.integers(0, 2),
        st.sampled_from([IN_FLIGHT, QUEUED, DECODES, MEAN_CONTEXT, PAIRS]),
        st.sampled_from([0.0, 1.0, 250.0]),
    ),
)


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(_OPS, max_size=30))
def test_a_booking_reply_that_repeats_the_store_leaves_it_and_its_rows_alone(
    ops: list[tuple[Any, ...]],
) -> None:
    """`apply_some` skips the rows a reply would not move: the plane reads the same
    values as when it moved every row, under any mix of polls, replies, own bookings
    and the engines' gauges (the mean context included), and every row whose values
    changed is still marked for the plane's load orders."""
    rows = {EngineKey(5, 0): 0, EngineKey(5, 1): 1, EngineKey(7, 0): 2}
    stores = (SharedLoadStore(rows=3), _AlwaysMoves(rows=3))
    marked: tuple[set[int], set[int]] = (set(), set())
    for store, seen in zip(stores, marked, strict=True):
        store.bind(rows.get)
        for r in range(3):
            store.add(r)
        store.watch(seen.add)
    for op in ops:
        before = stores[0].rows(slice(None)).copy()
        marked[0].clear()
        for store in stores:
            kind, *a = op
            if kind == "some":
                store.apply_some(a[0])
            elif kind == "snapshot":
                store.apply_snapshot(a[0])
            elif kind == "booked":
                store.own_booked(a[0], a[1], a[2])
            elif kind == "prefilled":
                store.own_prefilled(a[0], a[1], a[2])
            elif kind == "released":
                store.own_released(a[0], a[1], a[2], a[3])
            else:
                store.report(a[0], {a[1]: a[2]})
        assert np.array_equal(stores[0].rows(slice(None)), stores[1].rows(slice(None)))
        assert all(stores[0].booked(k) == stores[1].booked(k) for k in rows)
        moved = {r for r in range(3) if not np.array_equal(before[r], stores[0].rows(r))}
        assert moved <= marked[0]
