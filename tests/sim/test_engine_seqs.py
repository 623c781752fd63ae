"""Per-engine sequence slots in the simulator (a fleet of mixed GPUs): the engine runs
with its own `max_num_seqs`, and the gateway is told, so a slot-aware router sends the
small engine less."""

from __future__ import annotations

import itertools
import subprocess
import sys
from typing import Any

import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.routing import Decision, Request, Router, View
from quillcache.sim.generators import shared_prefix
from quillcache.sim.runner import SimConfig, run

WORKLOAD = shared_prefix(requests=400, prefix_groups=8, rate=40.0, seed=2)


def _share_on_0(config: SimConfig) -> tuple[float, list[tuple[float, float]]]:
    res = run(WORKLOAD, "quillcache", "native", config, CostModel())
    on0 = [r for r in res.records if r.worker == 0]
    spans = sorted((r.first_token_s, r.finish_s) for r in on0)
    return len(on0) / len(res.records), spans


class _Recording(Router):
    """Least requests in flight, remembering each row's slots as the router saw them."""

    name = "recording"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.seen: dict[int, set[int]] = {}

    def route(self, request: Request, view: View) -> Decision:
        for w in view.workers:
            self.seen.setdefault(w.worker, set()).add(w.max_num_seqs)
        return self.decide(request, view, min(view.workers, key=lambda w: w.in_flight))


def test_one_slot_engine_runs_one_request_at_a_time_and_gets_fewer() -> None:
    mixed, spans = _share_on_0(SimConfig(workers=4, max_num_seqs={0: 1}))
    even, _ = _share_on_0(SimConfig(workers=4))
    # one slot: a request's decode ends before the next one's first token there
    assert len(spans) >= 2
    assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))
    assert mixed < even * 0.7, (mixed, even)


def test_the_gateway_is_told_each_engines_slots() -> None:
    router = _Recording()
    config = SimConfig(workers=3, max_num_seqs={0: 1, 2: 48})
    run(WORKLOAD, router, "native", config, CostModel())
    # 0: the cost model's (the engine's own default); per-rank slots as configured
    assert router.seen == {0: {1}, 1: {0}, 2: {48}}


@pytest.mark.parametrize(
    ("seqs", "needle"),
    [({4: 2}, "worker 4 is not one of the 4"), ({0: 0}, "whole number >= 1")],
)
def test_bad_slots_are_config_errors(seqs: dict[int, int], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        run(WORKLOAD, "quillcache", "native", SimConfig(workers=4, max_num_seqs=seqs), CostModel())


def test_the_cli_flag() -> None:
    base = [sys.executable, "-m", "quillcache", "simulate", "--workload", "shared-prefix"]
    base += ["--gen", "requests=80", "--workers", "2", "--routers", "quillcache", "--no-progress"]
    ok = subprocess.run([*base, "--engine-seqs", "1=4"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([*base, "--engine-seqs", "x=4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "'x' is not a worker number" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_a_matrix_cell_names_engines_slots() -> None:
    from quillcache.sim.matrix import parse_grid

    cell = '[[cells]]\nname = "mixed"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
    grid = parse_grid(cell + "engines = 4\nmax_num_seqs = { 0 = 2, 3 = 64 }\n")
    assert grid.cells[0].max_num_seqs == ((0, 2), (3, 64))
    assert grid.cells[0].key()["max_num_seqs"] == {"0": 2, "3": 64}
    for bad, needle in (("{ 4 = 2 }", "not one of the cell's 4"), ("{ 0 = 1.5 }", "not a valid")):
        with pytest.raises(ConfigError, match=needle):
            parse_grid(cell + f"engines = 4\nmax_num_seqs = {bad}\n")
