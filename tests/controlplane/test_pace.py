"""Each engine's pace: learned from observed against estimated TTFT, relative to the
fleet's median, with hysteresis; a slower engine is priced slower by `quillcache` and
nothing changes for a uniform fleet."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.controlplane import ControlPlane
from quillcache.controlplane.pace import PaceConfig, PaceLearner
from quillcache.errors import ConfigError
from quillcache.routing import Request

BS = 16


class Paces:
    """The learner with its writes recorded, as the plane's fleet column would hold them."""

    def __init__(self, config: PaceConfig | None = None) -> None:
        self.written: dict[int, float] = {}
        self.learner = PaceLearner(self._write, config)

    def _write(self, row: int, pace: float) -> None:
        self.written[row] = pace


def feed(p: Paces, row: int, ratio: float, times: int, estimate: float = 0.5) -> None:
    for _ in range(times):
        p.learner.observe(row, estimate * ratio, estimate)


@settings(max_examples=150, deadline=None)
@given(
    rows=st.integers(3, 12),
    scale=st.floats(0.05, 20.0),
    noise=st.lists(st.floats(0.7, 1.4), min_size=40, max_size=400),
)
def test_a_uniform_fleet_gets_no_pace(rows: int, scale: float, noise: list[float]) -> None:
    """Engines that all run at the same speed (however far the cost model is from it,
    `scale`, and with per-request noise within the on-ratio) are never paced: the
    routers see exactly 1.0."""
    p = Paces()
    for i, n in enumerate(noise):
        p.learner.observe(i % rows, 0.3 * scale * n, 0.3)
    p.learner.refresh()
    assert not p.learner.paced
    assert all(v == 1.0 for v in p.written.values())


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(3, 10), slow=st.floats(2.5, 50.0), scale=st.floats(0.1, 10.0))
def test_a_slow_engine_gets_its_slowdown_as_pace(rows: int, slow: float, scale: float) -> None:
    p = Paces()
    for _ in range(16):
        for r in range(rows):
            p.learner.observe(r, 0.2 * scale * (slow if r == 0 else 1.0), 0.2)
    p.learner.refresh()
    assert p.learner.paced
    assert math.isclose(p.learner.pace(0), slow, rel_tol=1e-9)
    assert all(p.learner.pace(r) == 1.0 for r in range(1, rows))
    assert math.isclose(p.written[0], slow, rel_tol=1e-9)


def test_hysteresis_and_recovery() -> None:
    p = Paces(PaceConfig(window=8, min_samples=8, refresh_every=1))
    for r in (1, 2, 3):
        feed(p, r, 1.0, 8)
    feed(p, 0, 3.0, 8)
    assert p.learner.pace(0) == pytest.approx(3.0)
    feed(p, 0, 1.7, 8)  # between off (1.6) and on (2.0): stays paced
    assert p.learner.pace(0) == pytest.approx(1.7)
    feed(p, 0, 1.2, 8)  # recovered
    assert p.learner.pace(0) == 1.0 and p.written[0] == 1.0 and not p.learner.paced
    feed(p, 0, 1.9, 8)  # below on: not paced again
    assert p.learner.pace(0) == 1.0


def test_the_sum_decides_not_the_short_prompts() -> None:
    """Short prompts that share an engine step with a long one see many times their
    estimate on any engine; the engine's ratio is that of the summed times."""
    p = Paces(PaceConfig(window=16, min_samples=8, refresh_every=1))
    for r in (1, 2, 3):
        feed(p, r, 1.0, 16)
    for _ in range(4):  # a long prompt as estimated, three short ones 5x late
        p.learner.observe(0, 2.0, 2.0)
        for _ in range(3):
            p.learner.observe(0, 0.3, 0.06)
    assert not p.learner.paced


def test_too_few_rows_or_samples_pace_nothing_and_junk_teaches_nothing() -> None:
    p = Paces(PaceConfig(refresh_every=1))
    feed(p, 0, 10.0, 50)
    feed(p, 1, 1.0, 50)
    assert not p.learner.paced  # two rows: no fleet to compare with
    feed(p, 2, 1.0, 7)  # one sample short
    assert not p.learner.paced
    for bad in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (math.nan, 1.0), (math.inf, 1.0)):
        p.learner.observe(2, *bad)
    assert not p.learner.paced
    feed(p, 2, 1.0, 1)
    assert p.learner.paced and p.learner.pace(0) == pytest.approx(10.0)
    p.learner.forget(0)
    assert not p.learner.paced and p.written[0] == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"window": 4, "min_samples": 5},
        {"min_samples": 0},
        {"min_rows": 1},
        {"refresh_every": 0},
        {"on_ratio": 1.5, "off_ratio": 1.6},
        {"off_ratio": 1.0},
        {"on_ratio": 200.0},
    ],
)
def test_bad_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="pace"):
        PaceConfig(**bad)  # type: ignore[arg-type]


def _request(rid: int, tokens: int = 2048) -> Request:
    keys = np.arange(rid * 1000 + 1, rid * 1000 + 1 + tokens // BS, dtype=np.uint64)
    return Request(rid, keys, tokens, expected_output_tokens=16, arrival_s=float(rid))


def test_the_plane_learns_a_slow_engine_and_quillcache_avoids_it() -> None:
    """Requests whose first token comes 10 times later than estimated on engine 0 (the
    others as estimated) give engine 0 a pace of about 10; `quillcache` then prices it
    so, and a request that engine 0 would win at the fleet's speed (the shortest
    queue) goes elsewhere. Without the observed times (`now_s`), nothing is learned
    and engine 0 keeps winning."""
    outcomes = []
    for learn in (True, False):
        cp = ControlPlane(index="native", router="quillcache", block_size=BS, track_load=True)
        for w in range(4):
            cp.add_worker(w)
        now = 0.0
        rid = 0
        for _ in range(12):
            for w in range(4):
                rid += 1
                request = _request(rid)
                # each engine's turn: the others busy, so `quillcache` picks `w`
                for other in range(4):
                    cp.update_load(other, queued_prefill_tokens=0.0 if other == w else 50_000.0)
                d = cp.route(request, now_s=now)
                assert d.worker == w
                tracked = cp._tracked[rid]
                # (the plane keeps what pace needs once a `prefill_done` came with a time)
                expected = cp._expected_ttft_s(tracked) if tracked.load_at_route else 0.1
                took = expected * (10.0 if w == 0 else 1.0)
                cp.prefill_done(rid, now + took if learn else None)
                cp.finish(rid)
                now += 1.0
        # engine 0 idle, the others with a short queue: at the fleet's speed, 0 wins
        cp.update_load(0, queued_prefill_tokens=0.0)
        for other in (1, 2, 3):
            cp.update_load(other, queued_prefill_tokens=1024.0)
        rid += 1
        d = cp.route(_request(rid), now_s=now)
        outcomes.append((d.worker, cp.pace.pace(cp._state(0).rows[0])))
        cp.close()
    (learned_worker, pace), (blind_worker, blind_pace) = outcomes
    assert pace == pytest.approx(10.0, rel=0.01)
    assert learned_worker != 0
    assert blind_pace == 1.0 and blind_worker == 0


def test_a_paced_engine_s_estimate_and_slo_admission_see_its_pace() -> None:
    """The decision's estimate on a paced engine is that many times longer (what SLO
    admission judges): a request whose SLO the fleet's speed would meet on it is
    refused when the engine is the only one and 10 times slower."""
    from quillcache.routing import SLO

    quick = PaceConfig(window=1, min_samples=1, min_rows=2, refresh_every=1)
    cp = ControlPlane(
        index="native", router="quillcache", block_size=BS, track_load=True, pace=quick
    )
    rows = [cp.add_worker(w).rows[0] for w in range(3)]
    fast = cp.route(_request(1), now_s=0.0, only=frozenset({0}))
    assert fast.estimate is not None and fast.worker == 0
    cp.finish(1)
    for row in rows:  # engine 0 took 10 times its estimate, the others as estimated
        cp.pace.observe(row, 10.0 if row == rows[0] else 1.0, 1.0)
    assert cp.pace.pace(rows[0]) == pytest.approx(10.0)
    slow = cp.route(_request(2), now_s=0.0, only=frozenset({0}))
    assert slow.estimate is not None
    assert slow.estimate.prefill_s == pytest.approx(10 * fast.estimate.prefill_s)
    assert slow.estimate.transfer_s == fast.estimate.transfer_s
    cp.finish(2)
    slo = SLO(ttft_s=3 * fast.estimate.ttft_s)
    request = _request(3)
    request.slo = slo
    refused = cp.route(request, now_s=0.0, only=frozenset({0}))
    assert refused.rejected, refused
    cp.close()
