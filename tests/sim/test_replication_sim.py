"""Hot-prefix replication in the timed simulator: replicas are real prefills on the
target engines, counted as the policy's cost, and leave the workload's records alone
when no request is routed to them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.errors import ConfigError
from quillcache.routing import Decision, Request, Router, View
from quillcache.sim.generators import shared_prefix
from quillcache.sim.replicate import ReplicateSettings
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import Workload


class FirstWorker(Router):
    """Every request to worker 0: its queue grows while the others idle."""

    name = "first-worker"

    def route(self, request: Request, view: View) -> Decision:
        return Decision(0)


FAST = {"period_s": 0.2, "min_rate": 1.0, "high_wait_s": 0.05, "low_wait_s": 0.01}


def _workload() -> Workload:
    return shared_prefix(
        requests=200,
        prefix_groups=1,
        shared_prefix_blocks=64,
        unique_blocks=4,
        output_tokens=16,
        rate=200.0,
        seed=3,
    )


def test_replicas_are_prefills_on_idle_engines() -> None:
    wl = _workload()
    cost = CostModel(CostModelConfig())
    settings = ReplicateSettings.parse({**FAST, "cooldown_s": 0.3, "max_replicas": 3})
    off = run(wl, FirstWorker(), "native", SimConfig(workers=4), cost)
    on = run(wl, FirstWorker(), "native", SimConfig(workers=4, replicate=settings), cost)
    s_off, s_on = off.summary(), on.summary()
    assert "replications" not in s_off
    # the hot prefix (64 blocks, counted at its 64-block anchor) went to the idlest
    # engine (1: the lowest id of three idle ones), which computed all of it; that
    # holder stays idle (nothing routes there), so the prefix is no longer overloaded
    assert s_on["replications"] == 1
    assert s_on["replication_blocks"] == 64
    assert s_on["replication_prefill_tokens"] == 64 * wl.block_size
    assert s_on["replication_prefill_pct"] == pytest.approx(
        100 * s_on["replication_prefill_tokens"] / s_on["prefill_tokens_computed"], abs=1e-3
    )
    # no workload request went to a replica's engine: the requests are served alike
    assert [(r.rid, r.worker, r.first_token_s) for r in on.records] == [
        (r.rid, r.worker, r.first_token_s) for r in off.records
    ]
    # the replicas' blocks reached the index through the engines' events
    assert on.events_applied > off.events_applied


def test_bad_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown"):
        ReplicateSettings.parse({"high_water": 1})
    with pytest.raises(ConfigError, match="not a number"):
        ReplicateSettings.parse({"max_replicas": 1.5})
    with pytest.raises(ConfigError, match="low_wait_s"):
        ReplicateSettings.parse({"high_wait_s": 0.1, "low_wait_s": 0.2})
    with pytest.raises(ConfigError, match="period_s"):
        ReplicateSettings.parse({"period_s": 0})
    cfg = SimConfig(workers=2, timing="none", replicate=ReplicateSettings())
    with pytest.raises(ConfigError, match="full timing"):
        cfg.check()


def test_cli_reports_the_cost() -> None:
    args = [sys.executable, "-m", "quillcache", "simulate", "--routers", "quillcache"]
    args += ["--requests", "150", "--prefix-groups", "2", "--jobs", "1", "--no-progress"]
    proc = subprocess.run(
        [*args, "--replicate-opt", "high_wait_s=0.05", "--replicate-opt", "low_wait_s=0.01"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr
    assert "copy tok %" in proc.stdout
    bad = subprocess.run(
        [*args, "--replicate-opt", "nope=1"], capture_output=True, text=True, timeout=240
    )
    assert bad.returncode == 2 and "replication option 'nope' unknown" in bad.stderr
    none = subprocess.run(
        [*args, "--replicate", "--timing", "none"], capture_output=True, text=True, timeout=240
    )
    assert none.returncode == 2 and "--timing full" in none.stderr


GRID = """\
routers = ["quillcache"]
seeds = 1

[workloads.small]
generator = "shared-prefix"
requests = 120
prefix_groups = 1
shared_prefix_blocks = 32

[[cells]]
name = "plain"
workload = "small"
setup = "llama-8b-a100"
engines = 2

[[cells]]
name = "replicated"
workload = "small"
setup = "llama-8b-a100"
engines = 2
replicate = { high_wait_s = 0.05, low_wait_s = 0.01, min_rate = 1 }
"""


def test_a_grid_cell_runs_the_policy() -> None:
    from quillcache.sim import matrix

    grid = matrix.parse_grid(GRID)
    plain, replicated = grid.cells
    assert plain.replicate is None
    assert replicated.key()["replicate"] == {"high_wait_s": 0.05, "low_wait_s": 0.01, "min_rate": 1}
    matrix._STATE["grid"] = grid
    kept_plain, _ = matrix.run_task((0, 0, "quillcache"))
    kept, _ = matrix.run_task((1, 0, "quillcache"))
    assert "replications" not in kept_plain
    assert isinstance(kept["replications"], int)
    assert isinstance(kept["replication_prefill_pct"], float)
    summary = matrix.summarize(grid, [kept_plain, kept])
    assert "replications" in summary["cells"][1]["routers"]["quillcache"]
    bad = GRID.replace("min_rate = 1", "nope = 1")
    with pytest.raises(ConfigError, match=r"cells\[1\].replicate.*'nope' unknown"):
        matrix.parse_grid(bad)
