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
        interval_s=lambda engine: 5.0,
        place=lambda t: 3,
        now_s=10.0,
        min_interval_s=2.0,
    )
    assert again == []


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
