"""Bursty arrivals for the shared-prefix generator (`burst_factor`): an on/off
modulated Poisson process whose mean is the generator's rate."""

from __future__ import annotations

import numpy as np
import pytest

from quillcache.errors import ConfigError
from quillcache.sim.generators import _bursty_arrivals, shared_prefix


@pytest.mark.parametrize("factor, share", [(3.0, 0.2), (5.0, 0.2), (2.0, 0.5)])
def test_bursts_keep_the_mean_rate_and_put_factor_x_share_of_the_arrivals_in_them(
    factor: float, share: float
) -> None:
    rate, period = 20.0, 10.0
    t = _bursty_arrivals(np.random.default_rng(1), 40_000, rate, factor, period, share)
    assert len(t) == 40_000 and np.all(np.diff(t) > 0)
    assert len(t) / t[-1] == pytest.approx(rate, rel=0.03)
    inside = np.mod(t, period) < share * period
    assert inside.mean() == pytest.approx(factor * share, abs=0.02)
    # inside a burst the rate is factor x the mean
    bursting_s = share * period * np.ceil(t[-1] / period)
    assert inside.sum() / bursting_s == pytest.approx(rate * factor, rel=0.05)


def test_no_burst_is_the_generator_as_before() -> None:
    a = shared_prefix(requests=200, seed=4)
    b = shared_prefix(requests=200, seed=4, burst_factor=1.0, burst_period_s=3.0)
    assert [r.arrival_s for r in a.requests] == [r.arrival_s for r in b.requests]
    assert "burst_factor" not in a.params
    c = shared_prefix(requests=200, seed=4, burst_factor=3.0)
    assert c.params["burst_factor"] == 3.0
    assert [r.arrival_s for r in c.requests] != [r.arrival_s for r in a.requests]


@pytest.mark.parametrize(
    "factor, period, share",
    [(0.5, 10.0, 0.2), (6.0, 10.0, 0.2), (2.0, 0.0, 0.2), (2.0, 10.0, 0.0), (2.0, 10.0, 1.0)],
)
def test_impossible_bursts_are_a_config_error(factor: float, period: float, share: float) -> None:
    with pytest.raises(ConfigError, match="bursts need"):
        shared_prefix(requests=10, burst_factor=factor, burst_period_s=period, burst_share=share)
