"""The replication policy: when it acts, where, and that it does not thrash."""

from __future__ import annotations

import itertools
from collections.abc import Collection

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.errors import ConfigError
from quillcache.policy.heat import HotPrefix
from quillcache.policy.replication import (
    EngineLoad,
    Replicate,
    ReplicationConfig,
    ReplicationPolicy,
)

CFG = ReplicationConfig(high_wait_s=2.0, low_wait_s=0.5, cooldown_s=10.0, max_replicas=2)


def prefix(key: int, rate: float = 5.0, blocks: int = 8) -> HotPrefix:
    return HotPrefix(key, blocks, rate, np.arange(key, key + blocks, dtype=np.uint64))


def loads(*waits: float) -> list[EngineLoad]:
    return [EngineLoad(w, s) for w, s in enumerate(waits)]


def test_replicates_onto_the_idlest_non_holder() -> None:
    pol = ReplicationPolicy(CFG)
    got = pol.decide([prefix(7)], {7: {0}}, loads(5.0, 0.3, 0.1, 0.1), 0.0)
    assert got == [Replicate(7, 8, 2)]  # 2 and 3 tie at 0.1: the lower id


def test_no_action_while_a_holder_has_room() -> None:
    pol = ReplicationPolicy(CFG)
    # holder 1 waits 1.0 (below the high mark): the router can still use it
    assert pol.decide([prefix(7)], {7: {0, 1}}, loads(5.0, 1.0, 0.0, 0.0), 0.0) == []
    # nobody holds it: routing places it, not replication
    assert pol.decide([prefix(7)], {7: set()}, loads(5.0, 5.0, 0.0, 0.0), 0.0) == []
    # nobody idle
    assert pol.decide([prefix(7)], {7: {0}}, loads(5.0, 0.6, 0.6, 0.6), 0.0) == []


def test_cooldown_replica_cap_and_hysteresis() -> None:
    pol = ReplicationPolicy(CFG)
    holders: dict[int, set[int]] = {7: {0}}
    assert pol.decide([prefix(7)], holders, loads(5, 0, 0, 0), 0.0) == [Replicate(7, 8, 1)]
    # within the cooldown: nothing, even though still overloaded
    assert pol.decide([prefix(7)], holders, loads(5, 0, 0, 0), 9.9) == []
    holders[7] = {0, 1}
    loaded = loads(5, 3, 0, 0)
    assert pol.decide([prefix(7)], holders, loaded, 10.0) == [Replicate(7, 8, 2)]
    holders[7] = {0, 1, 2}
    # two extra replicas hold it: the cap
    assert pol.decide([prefix(7)], holders, loads(5, 3, 3, 0), 30.0) == []
    # replica 1 evicted it: room for one more
    holders[7] = {0, 2}
    assert pol.decide([prefix(7)], holders, loads(5, 0, 3, 0), 40.0) == [Replicate(7, 8, 1)]
    # a holder below the low mark ends it; between the marks it stays inactive
    holders[7] = {0, 1, 2}
    assert pol.decide([prefix(7)], holders, loads(5, 0.4, 3, 0), 60.0) == []
    holders[7] = {0}
    assert pol.decide([prefix(7)], holders, loads(1.5, 0, 0, 0), 80.0) == []


def test_no_copy_while_the_router_spreads_the_prefix_itself() -> None:
    pol = ReplicationPolicy(CFG)
    holders = {7: {0}}
    # engine 1 computes the prefix for a routed request (the router's own spill): a
    # copy onto 2 would double it
    assert pol.decide([prefix(7)], holders, loads(5, 3, 0, 0), 0.0, {7: {0, 1}}) == []
    # an engine outside the routable ones, or a holder computing it again, is no spill
    assert pol.decide([prefix(7)], holders, loads(5, 3, 0, 0), 0.0, {7: {0, 9}}) == [
        Replicate(7, 8, 2)
    ]
    # the spill landed and the holders are still overloaded: a copy is made
    pol = ReplicationPolicy(CFG)
    assert pol.decide([prefix(7)], holders, loads(5, 3, 0, 0), 0.0, {7: {1}}) == []
    got = pol.decide([prefix(7)], {7: {0, 1}}, loads(5, 3, 0, 0), 0.5, lambda h: set())
    assert got == [Replicate(7, 8, 2)]


def test_one_replica_per_engine_per_call_hottest_first() -> None:
    pol = ReplicationPolicy(CFG)
    hot = [prefix(1, rate=1.0), prefix(2, rate=9.0)]
    got = pol.decide(hot, {1: {0}, 2: {0}}, loads(5, 0.2, 5, 0.3), 0.0)
    assert got == [Replicate(2, 8, 1), Replicate(1, 8, 3)]


def test_holders_may_be_a_callable() -> None:
    pol = ReplicationPolicy(CFG)

    def held(h: HotPrefix) -> Collection[int]:
        return {int(h.keys[0]) % 2, 9}  # 9 is not routable: ignored

    assert pol.decide([prefix(4)], held, loads(5, 0, 0), 0.0) == [Replicate(4, 8, 1)]


def test_bad_config_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="low_wait_s"):
        ReplicationPolicy(ReplicationConfig(high_wait_s=1.0, low_wait_s=2.0))
    with pytest.raises(ConfigError, match="cooldown_s"):
        ReplicationPolicy(ReplicationConfig(cooldown_s=-1))
    with pytest.raises(ConfigError, match="max_replicas"):
        ReplicationPolicy(ReplicationConfig(max_replicas=-1))


rounds = st.lists(
    st.tuples(
        st.floats(0.1, 8.0),  # time step
        st.lists(st.floats(0.0, 6.0), min_size=4, max_size=4),  # waits of 4 engines
        st.lists(st.sets(st.integers(0, 3), max_size=3), min_size=3, max_size=3),  # holders
        st.lists(st.sets(st.integers(0, 4), max_size=2), min_size=3, max_size=3),  # computing
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(rounds=rounds, max_replicas=st.integers(0, 3))
def test_invariants(
    rounds: list[tuple[float, list[float], list[set[int]], list[set[int]]]], max_replicas: int
) -> None:
    cfg = ReplicationConfig(
        high_wait_s=2.0, low_wait_s=0.5, cooldown_s=10.0, max_replicas=max_replicas
    )
    pol = ReplicationPolicy(cfg)
    fresh = ReplicationPolicy(cfg)
    now = 0.0
    last: dict[int, float] = {}
    hot = [prefix(k, rate=float(k)) for k in range(3)]
    for dt, waits, held, busy in rounds:
        now += dt
        holders = {k: held[k] for k in range(3)}
        computing = {k: busy[k] for k in range(3)}
        got = pol.decide(hot, holders, loads(*waits), now, computing)
        targets = [a.target_worker for a in got]
        assert len(targets) == len(set(targets))  # one replica per engine per call
        for a in got:
            assert a.target_worker not in holders[a.prefix_key]
            assert waits[a.target_worker] < cfg.low_wait_s
            assert all(waits[w] > cfg.high_wait_s for w in holders[a.prefix_key]) or (
                min(waits[w] for w in holders[a.prefix_key]) >= cfg.low_wait_s
            )
            # no thrash: one action per prefix per cooldown
            assert now - last.get(a.prefix_key, -1e9) >= cfg.cooldown_s
            last[a.prefix_key] = now
            # no copy beside a routed request computing it on a routable non-holder
            assert computing[a.prefix_key] <= holders[a.prefix_key] | {4}
        assert len(got) <= (3 if max_replicas else 0)
        # a policy with no history acts only on prefixes whose every holder is overloaded
        for a in fresh.decide(hot, holders, loads(*waits), 0.0):
            assert all(waits[w] > cfg.high_wait_s for w in holders[a.prefix_key])
        fresh = ReplicationPolicy(cfg)


@settings(max_examples=100, deadline=None)
@given(steps=st.lists(st.floats(0.01, 3.0), min_size=1, max_size=80))
def test_steady_overload_acts_once_per_cooldown(steps: list[float]) -> None:
    # holders never gain the replica (say it is evicted at once): still at most one
    # action per cooldown
    pol = ReplicationPolicy(CFG)
    now, times = 0.0, []
    for dt in steps:
        now += dt
        if pol.decide([prefix(3)], {3: {0}}, loads(9, 0, 0, 0), now):
            times.append(now)
    assert times and times[0] == steps[0]
    assert all(b - a >= CFG.cooldown_s for a, b in itertools.pairwise(times))
    assert len(times) <= 1 + (now - times[0]) // CFG.cooldown_s
