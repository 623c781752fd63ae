"""`quillcache simulate --matrix`: the grid parser's errors, a tiny grid end to end
(deterministic, --jobs 2 = --jobs 1, what each run measures), the verdicts, the page
and the heatmap."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.matrix import _verdict, load_grid, parse_grid
from quillcache.sim.runner import SimConfig, run

TINY = """\
description = "two cells, two routers"
routers = ["quillcache", "round-robin"]
seeds = 2

[workloads.small]
generator = "shared-prefix"
requests = 160
prefix_groups = 4
shared_prefix_blocks = 8
unique_blocks = 2

[axes]
workloads = ["small"]
setups = ["llama-8b-a100"]
engines = [2]
time_scale = [1.0, 0.5]
"""

GOOD_AXES = '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["llama-8b-a100"]\nengines = [2]\n'


def _matrix(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            'routers = ["quillcache", "nope"]\n' + GOOD_AXES,
            "line 1: routers: unknown router 'nope'",
        ),
        (
            '[axes]\nworkloads = ["shared-prefix", "nosuch"]\nsetups = ["llama-8b-a100"]\n'
            "engines = [2]\n",
            "line 2: axes.workloads: unknown workload 'nosuch'",
        ),
        (
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["h200"]\nengines = [2]\n',
            "line 3: axes.setups: unknown setup 'h200'",
        ),
        (
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["llama-8b-a100"]\nengines = [0]\n',
            "line 4: axes.engines: 0 is not a positive whole number",
        ),
        (
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["llama-8b-a100"]\nengines = [2]\n'
            "time_scale = [1, -1]\n",
            "line 5: axes.time_scale: -1 is not a positive number",
        ),
        ("[axes\nworkloads = 1\n", "not valid TOML: Expected ']'"),
        ('description = "x"\n', "no cells"),
        ("seeds = 0\n" + GOOD_AXES, "line 1: seeds: must be >= 1"),
        ("colour = 3\n" + GOOD_AXES, "line 1: colour: unknown key"),
        (
            '[workloads.x]\ngenerator = "shared-prefix"\nrequsts = 5\n',
            "line 3: workloads.x.requsts: not a parameter of shared-prefix",
        ),
        (
            '[workloads.x]\ngenerator = "shared-prefix"\nrequests = -5\n',
            "line 1: workloads.x: shared-prefix refuses these parameters",
        ),
        (
            '[workloads.x]\ngenerator = "zipf-storm"\n',
            "line 2: workloads.x.generator: unknown generator 'zipf-storm'",
        ),
        (
            '[workloads.x]\ngenerator = "multi-turn"\ntrace = "a.jsonl"\n',
            "workloads.x: give exactly one of trace",
        ),
        (
            '[setups.s]\nbase = "llama-8b-a100"\ncost = { "engine.nope" = 1 }\n',
            "line 3: setups.s.cost: unknown cost-model field 'engine.nope'",
        ),
        ('[setups.s]\nbase = "b200"\n', "line 2: setups.s.base: unknown setup 'b200'"),
        (
            '[[cells]]\nname = "a"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
            "engines = 4\nslow_workers = { 9 = 2.0 }\n",
            "line 6: cells[0].slow_workers.9: worker 9 is not one of the cell's 4 engines",
        ),
        (
            '[[cells]]\nname = "a"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
            "engines = 1\njoin_at_s = { 0 = 5.0 }\n",
            "cells[0].join_at_s: at least one engine must be there from the start",
        ),
        (
            '[[cells]]\nname = "a"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
            'engines = 4\n[[cells]]\nname = "b"\nworkload = "shared-prefix"\n',
            "line 6: cells[1].setup: missing",
        ),
        (
            '[workloads.t]\ntrace = "no-such-trace.jsonl"\n[[cells]]\nname = "a"\n'
            'workload = "t"\nsetup = "llama-8b-a100"\nengines = 2\n',
            "line 2: workloads.t.trace: trace 'no-such-trace.jsonl' not found",
        ),
        (
            '[setups.bs48]\nbase = "llama-8b-a100"\ncost = { "engine.block_size" = 48 }\n'
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["bs48"]\nengines = [2]\n'
            '[[cells]]\nname = "a"\nworkload = "sglang-gsp"\nsetup = "bs48"\nengines = 2\n',
            "line 6: axes.setups: cell 'shared-prefix / bs48 / 2 engines / time x1': setup "
            "'bs48' sets engine.block_size 48, which does not divide workload 'shared-prefix'",
        ),
        (
            '[setups.bs8]\nbase = "llama-8b-a100"\ncost = { "engine.block_size" = 8 }\n'
            '[setups.bs48]\nbase = "llama-8b-a100"\ncost = { "engine.block_size" = 48 }\n'
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = ["bs8"]\nengines = [2]\n'
            '[[cells]]\nname = "a"\nworkload = "sglang-gsp"\nsetup = "bs8"\nengines = 2\n'
            '[[cells]]\nname = "b"\nworkload = "sglang-gsp"\nsetup = "bs48"\nengines = 2\n',
            "line 19: cells[1].setup: cell 'b': setup 'bs48' sets engine.block_size 48",
        ),
        # entries of the wrong type are named, not a TypeError
        (
            '[axes]\nworkloads = [["tiny"]]\nsetups = ["llama-8b-a100"]\nengines = [2]\n',
            "axes.workloads: unknown workload ['tiny']",
        ),
        (
            '[axes]\nworkloads = ["shared-prefix"]\nsetups = [{a = 1}]\nengines = [2]\n',
            "axes.setups: unknown setup {'a': 1}",
        ),
        (
            '[[cells]]\nname = "a"\nworkload = ["x"]\nsetup = "llama-8b-a100"\nengines = 2\n',
            "cells[0].workload: unknown workload ['x']",
        ),
        ('[setups.s]\nbase = ["x"]\n', "setups.s.base: unknown setup ['x']"),
        ('[workloads.x]\ngenerator = ["shared-prefix"]\n', "workloads.x.generator: unknown"),
        ("seeds = [-1]\n", "seeds: seeds must be whole numbers from 0"),
        (
            '[[cells]]\nname = "a"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
            "engines = 4\nslow_workers = { 0 = inf }\n",
            "cells[0].slow_workers.0: inf is not a valid factor (at most 1000)",
        ),
        (
            '[[cells]]\nname = "a"\nworkload = "shared-prefix"\nsetup = "llama-8b-a100"\n'
            "engines = 4\nslow_workers = { 0 = 1e308 }\n",
            "is not a valid factor (at most 1000)",
        ),
    ],
)
def test_grid_errors_name_the_key_and_line(text: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_grid(text, origin="g.toml")
    assert f"grid g.toml{',' if 'line' in expected else ''}" in str(err.value)
    assert expected in str(err.value)


def test_shipped_grids_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the trace is looked up where a user keeps it; a clone need not sit beside ../shared
    (tmp_path / "mooncake_conversation_trace.jsonl").write_text("")
    monkeypatch.setenv("QUILLCACHE_TRACE_DIR", str(tmp_path))
    quick = load_grid("quick")
    assert {c.workload for c in quick.cells} == {
        "mooncake",
        "shared-prefix",
        "sglang-gsp",
        "multi-turn",
        "agent-fanout",
    }
    assert {(c.setup, c.engines, c.time_scale) for c in quick.cells} == {("llama-8b-a100", 8, 1.0)}
    full = load_grid("full")
    assert len(full.cells) == 5 * 3 * 4 * 3
    degenerate = load_grid("degenerate")
    assert any(c.slow_workers for c in degenerate.cells)
    assert any(c.join_at_s for c in degenerate.cells)


def test_bad_grid_exits_2_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "g.toml").write_text(GOOD_AXES.replace("shared-prefix", "nosuch"))
    proc = _matrix("--matrix", "g.toml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "axes.workloads: unknown workload 'nosuch'" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _matrix("--matrix", "quick", "--workers", "3", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--workers: not taken with --matrix" in proc.stderr


def test_tiny_grid_end_to_end(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    outs = {}
    for name, jobs in (("a", "1"), ("b", "1"), ("c", "2")):
        proc = _matrix("--matrix", "tiny.toml", "--jobs", jobs, "--out", name, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        outs[name] = (tmp_path / name / "matrix.json").read_text()
    assert outs["a"] == outs["b"], "same grid, same seeds: same JSON"
    assert outs["a"] == outs["c"], "--jobs 2 gives what --jobs 1 gives"

    results = json.loads(outs["a"])
    cells = results["cells"]
    assert [c["time_scale"] for c in cells] == [1.0, 0.5]
    assert all(set(c["routers"]) == {"quillcache", "round-robin"} for c in cells)
    # a run in the JSON is the simulator's run of that cell, seed and router
    grid = load_grid(str(tmp_path / "tiny.toml"))
    wl = grid.workloads["small"]
    from quillcache.sim.generators import GENERATORS

    workload = GENERATORS["shared-prefix"](**dict(wl.params), seed=1).scaled(0.5)
    direct = run(workload, "round-robin", "native", SimConfig(workers=2, seed=1), CostModel())
    summary = direct.summary()
    [recorded] = [r for r in cells[1]["runs"] if r["router"] == "round-robin" and r["seed"] == 1]
    assert recorded["ttft_mean_s"] == summary["ttft_mean_s"]
    assert recorded["ttft_p99_s"] == summary["ttft_p99_s"]
    # the cell's mean is the seeds' mean
    rr = [r for r in cells[1]["runs"] if r["router"] == "round-robin"]
    assert cells[1]["routers"]["round-robin"]["ttft_mean_s"] == pytest.approx(
        sum(r["ttft_mean_s"] for r in rr) / 2, abs=1e-6
    )

    page = (tmp_path / "a" / "matrix.md").read_text()
    for c in cells:
        assert f"#### {c['name']}" in page
    assert "| quillcache" in page and "| round-robin" in page
    png = (tmp_path / "a" / "matrix-heatmap.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def _row(mean: float, spread: float, rejected: int = 0) -> dict[str, float | int]:
    return {"ttft_mean_s": mean, "ttft_mean_spread_s": spread, "rejected": rejected}


@pytest.mark.parametrize(
    ("own", "other", "verdict", "winner"),
    [
        (_row(1.0, 0.0), _row(2.0, 0.0), "best", "quillcache"),
        (_row(1.05, 0.0), _row(1.0, 0.1), "within_spread", "least-loaded"),
        (_row(1.2, 0.5), _row(1.0, 0.1), "loses", "least-loaded"),
        # a router that rejected requests does not win on the TTFTs of the rest
        (_row(1.2, 0.0), _row(0.1, 0.0, rejected=3), "best", "quillcache"),
        (_row(0.1, 0.0, rejected=1), _row(1.0, 0.0), "rejects", "least-loaded"),
    ],
)
def test_verdict(own: dict[str, float], other: dict[str, float], verdict: str, winner: str) -> None:
    v = _verdict({"quillcache": own, "least-loaded": other}, "ttft_mean_s")
    assert (v["verdict"], v["winner"]) == (verdict, winner)


def test_slow_and_joining_workers() -> None:
    from quillcache.sim.generators import GENERATORS

    wl = GENERATORS["shared-prefix"](requests=300, prefix_groups=4, rate=20.0, seed=0)
    cost = CostModel()
    base = run(wl, "round-robin", "native", SimConfig(workers=4), cost)
    slow = run(wl, "round-robin", "native", SimConfig(workers=4, slow_workers={0: 10.0}), cost)

    def ttft(res: object, worker: int) -> float:
        recs = [r for r in res.records if r.worker == worker]  # type: ignore[attr-defined]
        return sum(r.first_token_s - r.arrival_s for r in recs) / len(recs)

    assert ttft(slow, 0) > 3 * ttft(base, 0)  # round-robin keeps sending it its share
    assert ttft(slow, 1) == pytest.approx(ttft(base, 1), rel=1e-9)
    join_s = wl.requests[150].arrival_s
    late = run(wl, "round-robin", "native", SimConfig(workers=4, join_at_s={3: join_s}), cost)
    on_3 = [r.arrival_s for r in late.records if r.worker == 3]
    assert on_3 and min(on_3) >= join_s
    with pytest.raises(ConfigError, match="slow worker 4 is not one of the 4 workers"):
        run(wl, "round-robin", "native", SimConfig(workers=4, slow_workers={4: 2.0}), cost)


# --- the checkpoint: a stopped grid resumes --------------------------------------------


def _json_without_perf(path: Path) -> dict[str, object]:
    data = json.loads(path.read_text())
    data.pop("perf", None)
    return data


def test_a_killed_grid_resumes_to_the_same_results(tmp_path: Path) -> None:
    """SIGKILL the matrix mid-grid; the same command finishes it without running the
    kept runs again, and its JSON is the bytes of an uninterrupted run."""
    import signal
    import time

    # runs long enough (about half a second each) that the kill lands mid-grid
    (tmp_path / "g.toml").write_text(TINY.replace("requests = 160", "requests = 3000"))
    cmd = [sys.executable, "-m", "quillcache", "simulate", "--no-progress"]
    args = ["--matrix", "g.toml", "--jobs", "1", "--out", "killed"]
    proc = subprocess.Popen([*cmd, *args], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    runs = tmp_path / "killed" / "runs.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if runs.exists() and runs.read_text().count("\n") >= 3:  # header + 2 runs
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the grid finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.stderr is not None
    proc.stderr.close()
    kept = runs.read_text().count("\n") - 1
    assert 2 <= kept < 8
    assert not (tmp_path / "killed" / "matrix.json").exists()

    again = _matrix(*args, "--perf", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"resuming: {kept} of 8 runs already done" in again.stderr
    perf = json.loads((tmp_path / "killed" / "matrix.json").read_text())["perf"]
    assert perf["resumed"] == kept
    assert runs.read_text().count("\n") == 1 + 8, "each run kept once"

    fresh = _matrix("--matrix", "g.toml", "--jobs", "2", "--out", "fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert _json_without_perf(tmp_path / "killed" / "matrix.json") == _json_without_perf(
        tmp_path / "fresh" / "matrix.json"
    )


def test_checkpoint_of_another_grid_is_refused(tmp_path: Path) -> None:
    (tmp_path / "g.toml").write_text(TINY)
    first = _matrix("--matrix", "g.toml", "--out", "o", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (tmp_path / "g.toml").write_text(TINY.replace("seeds = 2", "seeds = 3"))
    other = _matrix("--matrix", "g.toml", "--out", "o", cwd=tmp_path)
    assert other.returncode == 2
    assert "runs.jsonl is not a checkpoint of this grid" in other.stderr
    assert "--fresh" in other.stderr and "Traceback" not in other.stderr
    fresh = _matrix("--matrix", "g.toml", "--out", "o", "--fresh", cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr
    assert "resuming" not in fresh.stderr
    assert (tmp_path / "o" / "runs.jsonl").read_text().count("\n") == 1 + 12


def test_checkpoint_drops_a_cut_line_and_keeps_no_failures(tmp_path: Path) -> None:
    from quillcache.sim.matrix import tasks_of
    from quillcache.sim.matrix_checkpoint import Checkpoint

    grid = parse_grid(TINY)
    tasks = tasks_of(grid)
    path = tmp_path / "runs.jsonl"
    cp = Checkpoint.open(path, grid)
    cp.record(tasks[0], ({"router": tasks[0][2], "x": 0.1}, 1.5, None))
    cp.record(tasks[1], (None, 0.2, "it broke"))  # a failure: run again on resume
    cp.record(tasks[2], ({"router": tasks[2][2], "x": 0.3}, 2.5, None))
    cp.close()
    with path.open("a") as f:
        f.write('{"task": [1, 0, "quillc')  # a write cut by a kill
    again = Checkpoint.open(path, grid)
    again.close()
    assert again.dropped_partial_line
    assert sorted(again.done) == [0, 2]
    assert again.done[2] == ({"router": tasks[2][2], "x": 0.3}, 2.5, None)
    assert path.read_text().endswith("\n") and path.read_text().count("\n") == 3
    path.write_text("not json\n")
    with pytest.raises(ConfigError, match="no checkpoint header"):
        Checkpoint.open(path, grid)


def test_progress_lines_without_a_terminal(tmp_path: Path) -> None:
    """No terminal (CI, nohup): plain progress lines on stderr instead of a bar."""
    (tmp_path / "g.toml").write_text(TINY)
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--matrix", "g.toml", "--out", "o"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert "matrix: 8 of 8 runs (100%)" in proc.stderr
    quiet = _matrix("--matrix", "g.toml", "--out", "q", cwd=tmp_path)
    assert "matrix: " not in quiet.stderr


# --- seed-free runs are run once --------------------------------------------------------


def test_a_router_that_never_used_its_seed_decides_the_same_with_any_seed(
    tmp_path: Path,
) -> None:
    """The ground for running a trace cell's seed-free runs once: every built-in router
    that reports `seed_used` False after a run gives the same results with another
    seed; the randomised ones report True."""
    from quillcache.routing import BUILTIN_ORDER, create_router
    from quillcache.sim.matrix import _KEPT
    from quillcache.sim.trace import load_trace
    from tests.sim.trace_fixture import write_chained_trace

    path = tmp_path / "t.jsonl"
    write_chained_trace(path, seed=3)
    wl = load_trace(path)
    used = {}
    for name in BUILTIN_ORDER:
        results = []
        for seed in (0, 7):
            router = create_router(name, seed=seed)
            config = SimConfig(workers=3, seed=seed)
            summary = run(wl, router, "native", config, CostModel()).summary()
            results.append({k: summary[k] for k in _KEPT})
            used[name] = router.seed_used
        if not used[name]:
            assert results[0] == results[1], f"{name} said its seed was not used"
    assert used["random"] and used["power-of-two"]
    assert not used["round-robin"] and not used["quillcache"]


def test_a_trace_cell_runs_a_seed_free_router_once(tmp_path: Path) -> None:
    from quillcache.sim.matrix import _STATE, execute, run_task
    from tests.sim.trace_fixture import write_chained_trace

    write_chained_trace(tmp_path / "t.jsonl", seed=1)
    (tmp_path / "g.toml").write_text(
        'routers = ["quillcache", "random"]\nseeds = 3\n'
        '[workloads.t]\ntrace = "t.jsonl"\n'
        '[[cells]]\nname = "c"\nworkload = "t"\nsetup = "llama-8b-a100"\nengines = 3\n'
    )
    grid = load_grid(str(tmp_path / "g.toml"))
    outcome = execute(grid, jobs=1)
    runs = [r for r in outcome.runs if r is not None]
    own = [r for r in runs if r["router"] == "quillcache"]
    rnd = [r for r in runs if r["router"] == "random"]
    assert [r["seed"] for r in own] == [0, 1, 2]
    assert "same_run_as_seed" not in own[0]
    assert [r.get("same_run_as_seed") for r in own[1:]] == [0, 0]
    assert all("same_run_as_seed" not in r for r in rnd)
    cpu = dict(zip([(r["router"], r["seed"]) for r in runs], outcome.task_cpu_s, strict=True))
    assert cpu[("quillcache", 1)] == 0.0 and cpu[("random", 1)] > 0.0
    # a copied run is what running it gives
    _STATE["grid"] = grid
    try:
        direct, _ = run_task((0, 2, "quillcache"))
    finally:
        _STATE.clear()
    copied = {k: v for k, v in own[2].items() if k != "same_run_as_seed"}
    assert copied == direct


@pytest.mark.parametrize("flag", ["--json", "--plot"])
def test_matrix_outputs_that_cannot_be_written_are_refused_before_the_runs(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from quillcache.cli import main

    target = "/proc/no-such-dir/out." + ("json" if flag == "--json" else "png")
    code = main(["simulate", "--matrix", "quick", "--out", str(tmp_path / "o"), flag, target])
    assert code == 2
    said = " ".join(capsys.readouterr().err.split())  # (rich wraps long lines)
    assert f"{flag} {target}: the directory /proc/no-such-dir does not exist" in said


def test_a_grid_without_quillcache_does_not_claim_it_wins(tmp_path: Path) -> None:
    grid = TINY.replace('["quillcache", "round-robin"]', '["round-robin", "least-loaded"]')
    (tmp_path / "g.toml").write_text(grid.replace("seeds = 2", "seeds = 1"))
    proc = _matrix("--matrix", "g.toml", "--out", "o", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    text = (tmp_path / "o" / "matrix.md").read_text()
    assert "Not judged: `quillcache` is not among this grid's routers." in text
    assert "is best or within the winner's spread in every cell" not in text
