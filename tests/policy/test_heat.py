"""The heat tracker against a naive reference that keeps every observation time."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.errors import ConfigError
from quillcache.policy.heat import HeatTracker, anchor_depths


class Keys:
    """Chained keys of paths over a small alphabet: equal prefixes, equal keys."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, ...], int] = {}

    def of(self, path: tuple[int, ...]) -> np.ndarray:
        out = []
        for i in range(len(path)):
            out.append(self._ids.setdefault(path[: i + 1], 1000 + len(self._ids)))
        return np.array(out, dtype=np.uint64)


class NaiveHeat:
    """Every observation time per anchor; least recently seen anchor evicted."""

    def __init__(self, half_life_s: float, max_entries: int) -> None:
        self.tau = half_life_s / math.log(2)
        self.max = max_entries
        self.times: dict[int, list[float]] = {}
        self.keys: dict[int, list[int]] = {}
        self.order: list[int] = []

    def observe(self, keys: list[int], now: float) -> None:
        d = 1
        while d <= len(keys):
            k = keys[d - 1]
            if k in self.times:
                self.order.remove(k)
            else:
                self.times[k] = []
                self.keys[k] = keys[:d]
            self.order.append(k)
            self.times[k].append(now)
            if len(self.order) > self.max:
                old = self.order.pop(0)
                del self.times[old], self.keys[old]
            d *= 2

    def rate(self, k: int, now: float) -> float:
        return sum(math.exp(-(now - t) / self.tau) for t in self.times.get(k, [])) / self.tau

    def hot(self, now: float, min_rate: float, min_blocks: int) -> set[tuple[int, int]]:
        hot = {
            k
            for k in self.times
            if len(self.keys[k]) >= min_blocks and self.rate(k, now) >= min_rate
        }
        # maximal: drop an anchor whose next anchor (twice as deep) is hot too
        covered = {self.keys[k][len(self.keys[k]) // 2 - 1] for k in hot if len(self.keys[k]) > 1}
        return {(k, len(self.keys[k])) for k in hot if k not in covered}


paths = st.lists(st.integers(0, 1), min_size=0, max_size=9).map(tuple)
steps = st.lists(st.tuples(paths, st.floats(0, 5)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(
    steps=steps,
    half_life=st.floats(0.5, 20),
    max_entries=st.integers(1, 12),
    min_rate=st.floats(0.01, 2),
    min_blocks=st.integers(1, 4),
)
def test_matches_the_naive_reference(
    steps: list[tuple[tuple[int, ...], float]],
    half_life: float,
    max_entries: int,
    min_rate: float,
    min_blocks: int,
) -> None:
    keys = Keys()
    heat = HeatTracker(half_life_s=half_life, max_entries=max_entries)
    ref = NaiveHeat(half_life, max_entries)
    now = 0.0
    for path, dt in steps:
        now += dt
        k = keys.of(path)
        heat.observe(k, now)
        ref.observe([int(x) for x in k], now)
    assert len(heat) == len(ref.times) <= max_entries
    later = now + 1.0
    for key in ref.times:
        assert heat.rate(key, later) == pytest.approx(ref.rate(key, later), rel=1e-9)
    got = heat.hot(later, min_rate, min_blocks=min_blocks)
    # anchors within rounding of the threshold may fall either side
    near = {k for k in ref.times if abs(ref.rate(k, later) - min_rate) < 1e-9 * min_rate}
    want = ref.hot(later, min_rate, min_blocks)
    assert {(h.key, h.blocks) for h in got if h.key not in near} == {
        x for x in want if x[0] not in near
    }
    for h in got:
        assert list(h.keys) == ref.keys[h.key]
        assert h.keys[-1] == h.key and len(h.keys) == h.blocks
    assert [h.rate for h in got] == sorted((h.rate for h in got), reverse=True)


def test_a_steady_rate_converges_to_itself() -> None:
    heat = HeatTracker(half_life_s=2.0)
    k = np.arange(1, 21, dtype=np.uint64)
    for i in range(2000):
        heat.observe(k, i * 0.1)  # 10 requests a second
    assert heat.rate(16, 199.9) == pytest.approx(10.0, rel=0.05)
    assert heat.rate(20, 199.9) == 0.0  # 20 blocks: counted at 1, 2, 4, 8, 16
    # and halves every half life once the requests stop
    assert heat.rate(16, 201.9) == pytest.approx(heat.rate(16, 199.9) / 2, rel=1e-9)


def test_hot_reports_the_deepest_shared_anchor() -> None:
    heat = HeatTracker(half_life_s=5.0)
    shared = list(range(1, 41))  # a 40-block system prompt
    for i in range(50):
        own = [10_000 + 100 * i + j for j in range(8)]  # then 8 blocks of its own
        heat.observe(np.array(shared + own, dtype=np.uint64), i * 0.05)
    hot = heat.hot(2.5, min_rate=1.0)
    assert [(h.key, h.blocks) for h in hot] == [(32, 32)]  # 2**5 <= 40 < 2**6
    assert hot[0].rate > 1.0
    shallower = heat.hot(2.5, min_rate=1.0, maximal=False)
    assert [h.blocks for h in shallower] == [32, 16, 8, 4, 2, 1]  # same rate, longer first


def test_anchor_depths() -> None:
    assert anchor_depths(0) == []
    assert anchor_depths(1) == [1]
    assert anchor_depths(40) == [1, 2, 4, 8, 16, 32]
    assert anchor_depths(64) == [1, 2, 4, 8, 16, 32, 64]


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="half_life_s"):
        HeatTracker(half_life_s=0)
    with pytest.raises(ConfigError, match="max_entries"):
        HeatTracker(max_entries=0)
    heat = HeatTracker()
    with pytest.raises(ConfigError, match="uint64"):
        heat.observe(np.array([1, 2], dtype=np.int64), 0.0)
    heat.observe(np.array([], dtype=np.uint64), 0.0)
    assert len(heat) == 0
