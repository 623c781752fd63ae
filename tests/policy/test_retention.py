"""The retention decisions, the target store's bounds and the token budgets, against
written-out references."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.policy.budget import ActuationBudget, TokenBuckets
from quillcache.policy.retention import BlockRates, TouchTiming, WarmAction, plan
from quillcache.policy.targets import Target, TargetBudgetError, TargetKind, TargetStore


def target(
    name: str,
    tokens: int = 32,
    *,
    kind: TargetKind = TargetKind.PIN,
    tenant: str = "t",
    engine: int | None = None,
    expires_s: float = 100.0,
) -> Target:
    return Target(
        kind=kind,
        tenant=tenant,
        name=name,
        keys=np.arange(1, tokens // 16 + 1, dtype=np.uint64) + hash(name) % 1000 * 100,
        token_ids=list(range(tokens)),
        model="m",
        salt=None,
        expires_s=expires_s,
        engine=engine,
    )


def test_store_bounds_pins_per_tenant_and_everything_in_all() -> None:
    store = TargetStore(max_tokens=200, pin_budget_tokens=64)
    store.put(target("a", 32))
    store.put(target("b", 32))
    with pytest.raises(TargetBudgetError) as over:
        store.put(target("c", 32))
    assert over.value.limit == "pin_budget_tokens" and len(store) == 2
    store.put(target("a", 32))  # replacing a pin costs nothing more
    store.put(target("c", 32, tenant="u"))  # another tenant's budget
    with pytest.raises(TargetBudgetError) as full:
        store.put(target("s", 112, kind=TargetKind.SESSION))
    assert full.value.limit == "retention_max_tokens"
    assert store.tokens == 96
    assert [t.name for t in store.expire(100.0)] == ["a", "b", "c"]
    assert store.tokens == 0 and len(store) == 0


def test_touch_interval_follows_turnover() -> None:
    timing = TouchTiming(min_interval_s=1.0, max_interval_s=60.0, safety=0.25)
    assert timing.interval_s(1000, 0.0) == 60.0  # no new blocks: no pressure
    assert timing.interval_s(1000, 10.0) == 25.0  # turns over in 100 s
    assert timing.interval_s(1000, 1000.0) == 1.0  # never more often than the minimum
    assert timing.interval_s(0, 10.0) == 60.0


def test_block_rates_measure_the_slope() -> None:
    rates = BlockRates(half_life_s=1e-9)  # no memory: the last slope
    rates.observe(0, 0, 0.0)
    assert rates.rate(0) == 0.0
    rates.observe(0, 50, 5.0)
    assert rates.rate(0) == pytest.approx(10.0)
    rates.observe(0, 10, 6.0)  # the engine came back: its count restarted
    assert rates.rate(0) == 0.0


def test_plan_retains_holders_and_places_what_nobody_holds() -> None:
    pin, lost, session = (
        target("pin"),
        target("lost"),
        target("s", kind=TargetKind.SESSION, engine=2),
    )
    held = {pin.name: {0, 1}, lost.name: set(), session.name: {1, 2}}
    by_keys = {tuple(t.keys.tolist()): held[t.name] for t in (pin, lost, session)}
    pin.touched_s = {0: 9.0}  # touched a second ago: not due on engine 0
    out = plan(
        [pin, lost, session],
        holders_of=lambda keys: by_keys[tuple(keys.tolist())],
        computing_of=lambda keys: set(),
        interval_s=lambda engine: 5.0,
        place=lambda t: 3,
        now_s=10.0,
        min_interval_s=2.0,
    )
    got = [(w.target[2], w.engine, w.action) for w in out]
    assert got == [
        ("pin", 1, WarmAction.RETAIN),
        ("lost", 3, WarmAction.PREFETCH),
        ("s", 2, WarmAction.RETAIN),  # a session: its own engine only
    ]
    lost.touched_s[3] = 9.5  # just placed, its events not in yet: not again
    again = plan(
        [lost],
        holders_of=lambda keys: set(),
        computing_of=lambda keys: set(),
        interval_s=lambda engine: 5.0,
        place=lambda t: 3,
        now_s=10.0,
        min_interval_s=2.0,
    )
    assert again == []


def test_plan_leaves_a_prefix_being_computed_to_the_request_computing_it() -> None:
    """A session's turn queued on its engine longer than `min_interval_s`: the turn will
    compute (or is using) the prefix there, so no prefetch or touch doubles it; a pin
    being placed anywhere is not placed again."""
    session = target("s", kind=TargetKind.SESSION, engine=2)
    pin = target("pin")
    session.touched_s = {2: 0.0}
    pin.touched_s = {3: 0.0}

    def due(holders: set[int], computing: set[int], t: Target) -> list[tuple[int, WarmAction]]:
        out = plan(
            [t],
            holders_of=lambda keys: holders,
            computing_of=lambda keys: computing,
            interval_s=lambda engine: 5.0,
            place=lambda t: 3,
            now_s=10.0,
            min_interval_s=2.0,
        )
        return [(w.engine, w.action) for w in out]

    assert due(set(), set(), session) == [(2, WarmAction.PREFETCH)]
    assert due(set(), {2}, session) == []
    assert due(set(), {1}, session) == [(2, WarmAction.PREFETCH)]  # elsewhere: not its turn
    assert due({2}, {2}, session) == []  # held and in use there: no touch needed
    assert due({2}, set(), session) == [(2, WarmAction.RETAIN)]
    assert due(set(), set(), pin) == [(3, WarmAction.PREFETCH)]
    assert due(set(), {1}, pin) == []
    assert due({0, 1}, {1}, pin) == [(0, WarmAction.RETAIN)]


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.5, 100.0),
    st.floats(0.0, 10.0),
    st.lists(st.tuples(st.floats(0.0, 5.0), st.floats(0.0, 200.0)), max_size=30),
)
def test_token_bucket_matches_a_reference(
    rate: float, burst_s: float, asks: list[tuple[float, float]]
) -> None:
    burst = rate * burst_s
    buckets = TokenBuckets(rate, burst)
    level, at, now = burst, 0.0, 0.0
    for wait, tokens in asks:
        now += wait
        level = min(burst, level + (now - at) * rate)
        at = now
        expected = tokens <= level
        if expected:
            level -= tokens
        assert buckets.take("k", tokens, now) == expected


def test_budget_takes_from_both_or_neither() -> None:
    budget = ActuationBudget(engine_rate=100.0, tenant_rate=50.0, burst_s=1.0)
    assert budget.take(0, "a", 40, 0.0)
    assert not budget.take(1, "a", 20, 0.0)  # tenant a has 10 left
    assert budget.engines.level(1, 0.0) == 100.0  # engine 1 was not charged
    assert budget.take(1, "b", 20, 0.0)
    assert math.isclose(budget.tenants.level("a", 0.2), 20.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.booleans(),  # a pin (else a session)
            st.integers(1, 8),  # its blocks
            st.integers(0, 2),  # its engine / the engine holding it
            st.floats(0.0, 50.0),  # its expiry
            st.booleans(),  # held there (else: prefetched there)
        ),
        max_size=12,
    ),
    st.integers(0, 20),
)
def test_an_engine_keeps_targets_within_its_room_pins_then_the_latest_sessions(
    specs: list[tuple[bool, int, int, float, bool]], room: int
) -> None:
    """Against a reference: per engine, walk pins then sessions by expiry (latest
    first), keep each one that still fits the room; exactly those get a warm."""
    targets, held = [], {}
    for i, (is_pin, blocks, engine, expiry, is_held) in enumerate(specs):
        kind = TargetKind.PIN if is_pin else TargetKind.SESSION
        t = target(f"t{i}", blocks * 16, kind=kind, engine=engine, expires_s=100 + expiry)
        t.keys = np.arange(1, blocks + 1, dtype=np.uint64) + np.uint64(1000 * (i + 1))
        targets.append(t)
        held[int(t.keys[0])] = {engine} if is_held else set()
    out = plan(
        targets,
        holders_of=lambda keys: held[int(keys[0])],
        computing_of=lambda keys: set(),
        interval_s=lambda engine: 1.0,
        place=lambda t: 2 - (int(t.keys[0]) // 1000) % 2,  # a pin held nowhere: 1 or 2
        now_s=10.0,
        min_interval_s=1.0,
        room_blocks=lambda engine: float(room),
    )
    where = {}
    for i, t in enumerate(targets):
        on = specs[i][2] if (t.kind is TargetKind.SESSION or specs[i][4]) else None
        where[i] = on if on is not None else 2 - (int(t.keys[0]) // 1000) % 2
    expected = set()
    left = {e: room for e in range(3)}
    order = sorted(
        range(len(targets)),
        key=lambda i: (targets[i].kind is not TargetKind.PIN, -targets[i].expires_s, i),
    )
    for i in order:
        if len(targets[i].keys) <= left[where[i]]:
            left[where[i]] -= len(targets[i].keys)
            expected.add((targets[i].name, where[i]))
    assert {(w.target[2], w.engine) for w in out} == expected
    # and in the targets' order
    names = [w.target[2] for w in out]
    assert names == sorted(names, key=lambda n: int(n[1:]))
