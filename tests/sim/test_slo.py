"""SLO admission in the simulator (`SimConfig.slo`): the control plane's admission stage
after every router, under overload, against the same run without it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.routing import BUILTIN_ORDER, SLO
from quillcache.sim.generators import shared_prefix
from quillcache.sim.metrics import Record, meets
from quillcache.sim.runner import SimConfig, run

# `quillcache simulate --workload shared-prefix`'s shape (2,560-token prompts, 128 output
# tokens): 4 engines serve it at about 35 requests a second, so 75 a second is twice
# what they can take and their queues grow for the whole run
OVERLOAD = dict(
    requests=1500,
    prefix_groups=64,
    shared_prefix_blocks=128,
    unique_blocks=32,
    zipf=1.0,
    rate=75.0,
    output_tokens=128,
)
TTFT_SLO = SLO(ttft_s=2.0)


def _summary(router: str, admission: bool) -> dict[str, object]:
    config = SimConfig(workers=4, slo=TTFT_SLO, admission=admission)
    res = run(shared_prefix(**OVERLOAD), router, "native", config, CostModel())
    return res.summary()


@pytest.mark.parametrize("router", BUILTIN_ORDER)
def test_admission_keeps_the_admitted_within_the_slo_under_twice_the_load(router: str) -> None:
    held = _summary(router, admission=True)
    free = _summary(router, admission=False)
    assert free["rejected"] == 0
    assert isinstance(free["slo_met_share"], float) and free["slo_met_share"] < 0.5, free
    assert held["rejected"] > 0
    assert isinstance(held["slo_met_share"], float) and held["slo_met_share"] >= 0.95, held
    # rejecting early serves more requests within their SLO than serving them all late
    assert held["slo_goodput_share"] > free["slo_goodput_share"]


def test_without_an_slo_the_report_has_no_slo_columns() -> None:
    config = SimConfig(workers=4)
    res = run(shared_prefix(requests=100), "round-robin", "native", config, CostModel())
    assert not any(k.startswith("slo_") for k in res.summary())


def _rec(ttft: float, decode: float, out: int) -> Record:
    return Record(1, 0, 10.0, 100, 6, out, first_token_s=10.0 + ttft, finish_s=10.0 + ttft + decode)


def test_a_request_meets_its_slo_by_ttft_and_mean_time_between_tokens() -> None:
    slo = SLO(ttft_s=1.0, tbt_s=0.05)
    assert meets(_rec(0.9, 0.049 * 10, 11), slo)
    assert not meets(_rec(1.1, 0.0, 11), slo)
    assert not meets(_rec(0.5, 0.051 * 10, 11), slo)
    assert meets(_rec(0.5, 9.0, 1), slo)  # one output token: no time between tokens
    assert meets(_rec(5.0, 0.01, 11), SLO(tbt_s=0.05))


@pytest.mark.parametrize(
    "slo, timing, needle",
    [
        (SLO(ttft_s=-1.0), "full", "TTFT SLO must be a positive"),
        (SLO(ttft_s=math.inf), "full", "TTFT SLO must be a positive"),
        (SLO(tbt_s=0.0), "full", "TBT SLO must be a positive"),
        (SLO(), "full", "needs a TTFT or a TBT bound"),
        (SLO(ttft_s=1.0), "none", "full timing only"),
    ],
)
def test_bad_slos_are_a_config_error(slo: SLO, timing: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        SimConfig(slo=slo, timing=timing).check()  # type: ignore[arg-type]


GRID = """\
routers = ["quillcache", "round-robin"]
seeds = 1

[workloads.busy]
generator = "shared-prefix"
requests = 1500
prefix_groups = 64
shared_prefix_blocks = 128
unique_blocks = 32
zipf = 1.0
rate = 75.0

[[cells]]
name = "held"
workload = "busy"
setup = "llama-8b-a100"
engines = 4
slo = { ttft_s = 2.0 }

[[cells]]
name = "free"
workload = "busy"
setup = "llama-8b-a100"
engines = 4
slo = { ttft_s = 2.0, admission = false }
"""


def test_a_grid_cell_holds_its_slo() -> None:
    from quillcache.sim import matrix

    grid = matrix.parse_grid(GRID)
    held, free = grid.cells
    assert held.key()["slo"] == {"admission": True, "tbt_s": None, "ttft_s": 2.0}
    assert free.key()["slo"]["admission"] is False
    matrix._STATE["grid"] = grid
    runs = [matrix.run_task((c, 0, r))[0] for c in (0, 1) for r in grid.routers]
    cells = matrix.summarize(grid, runs)["cells"]
    for router in grid.routers:
        assert cells[0]["routers"][router]["slo_met_share"] >= 0.95
        assert cells[1]["routers"][router]["slo_met_share"] < 0.5
        assert cells[1]["routers"][router]["rejected"] == 0


@pytest.mark.parametrize(
    "slo, needle",
    [
        ("{ ttft_s = -2.0 }", "slo.ttft_s: must be a positive number"),
        ("{ tbt_s = true }", "slo.tbt_s: must be a positive number"),
        ("{ admission = false }", "slo: needs ttft_s or tbt_s"),
        ('{ ttft_s = 1.0, admission = "yes" }', "slo.admission: must be true or false"),
        ("{ ttft_s = 1.0, nope = 1 }", "nope"),
        ("2.0", "slo: must be a table"),
    ],
)
def test_bad_cell_slos_name_the_key(slo: str, needle: str) -> None:
    from quillcache.sim import matrix

    text = GRID.replace("slo = { ttft_s = 2.0 }", f"slo = {slo}")
    with pytest.raises(ConfigError, match=needle):
        matrix.parse_grid(text)


def test_the_slo_queue_serves_some_of_what_admission_refused() -> None:
    # bursts of 3x over a load the engines serve: a burst's queue drains after it, so
    # a request refused at its arrival can still be served within its SLO by waiting
    # (under a sustained 2x the queues never drain and waiting serves no more: the
    # capacity sets how many are refused in either mode)
    wl = shared_prefix(**{**OVERLOAD, "rate": 25.0, "burst_factor": 3.0})  # type: ignore[arg-type]
    refused = run(wl, "quillcache", "native", SimConfig(workers=4, slo=TTFT_SLO), CostModel())
    queued = run(
        wl, "quillcache", "native", SimConfig(workers=4, slo=TTFT_SLO, slo_queue=True), CostModel()
    )
    a, b = refused.summary(), queued.summary()
    assert "slo_waited" not in a
    assert b["slo_waited"] > 0 and 0 < b["slo_waiting_most"] <= 1024
    assert b["rejected"] < a["rejected"]
    assert b["slo_goodput_share"] > a["slo_goodput_share"]
    assert b["requests"] == a["requests"]
    late = sum("after waiting" in r.rejected for r in queued.records if r.rejected)
    assert 0 < late < b["slo_waited"]  # some waiters were refused in the end, not all


def test_the_slo_queue_holds_its_waiters_in_arrival_order_with_what_is_left() -> None:
    from quillcache.sim.requests import make_request
    from quillcache.sim.slo_wait import SloWaiters

    reqs = [make_request(i, 0.0, 4, 16, 0, tokens=np.arange(32, dtype=np.uint32)) for i in range(3)]
    q = SloWaiters(SLO(ttft_s=2.0, tbt_s=0.1), max_waiting=2, tick_s=0.5)
    assert not q.due(0.0)
    assert q.add(reqs[0], 1.0) and q.add(reqs[1], 1.2)
    assert not q.add(reqs[2], 1.3)  # full
    assert not q.due(1.4) and q.due(1.5)
    got = q.take(1.5)
    assert [r.rid for r, _ in got] == [0, 1]
    assert [left for _, left in got] == [SLO(ttft_s=1.5, tbt_s=0.1), SLO(ttft_s=1.7, tbt_s=0.1)]
    assert len(q) == 0 and not q.due(9.0)
    q.keep(reqs[1])
    assert not q.due(1.9) and q.due(2.0)
    assert [left for _, left in q.take(2.0)] == [SLO(ttft_s=1.2, tbt_s=0.1)]  # since 1.2
    assert q.stats() == {"slo_waited": 2, "slo_waiting_most": 2}


@pytest.mark.parametrize(
    "change, needle",
    [
        (dict(slo=None), "needs a TTFT SLO"),
        (dict(slo=SLO(tbt_s=0.1)), "needs a TTFT SLO"),
        (dict(admission=False), "needs a TTFT SLO and admission"),
        (dict(slo_queue_max=0), "slo_queue_max"),
        (dict(slo_queue_tick_s=5.0), "slo_queue_tick_s"),
    ],
)
def test_bad_slo_queues_are_a_config_error(change: dict[str, object], needle: str) -> None:
    config = SimConfig(slo=TTFT_SLO, slo_queue=True)
    for k, v in change.items():
        setattr(config, k, v)
    with pytest.raises(ConfigError, match=needle):
        config.check()
