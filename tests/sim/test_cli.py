"""`quillcache simulate` end to end, in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.sim.trace_fixture import write_chained_trace

SMALL = [
    "--requests",
    "120",
    "--prefix-groups",
    "4",
    "--shared-prefix-blocks",
    "8",
    "--unique-blocks",
    "2",
    "--no-progress",
]


def _sim(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", *args],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def test_default_style_table_lists_every_router() -> None:
    from quillcache.routing import BUILTIN_ORDER

    out = _sim(*SMALL).stdout
    for name in BUILTIN_ORDER:
        assert name in out
    assert "TTFT" in out and "block hit" in out


def test_json_is_deterministic_and_complete() -> None:
    args = [
        *SMALL,
        "--routers",
        "random,quillcache,sglang",
        "--backends",
        "memory,native",
        "--json",
        "-",
    ]
    a, b = _sim(*args).stdout, _sim(*args).stdout
    assert a == b
    data = json.loads(a)
    rows = data["results"]
    assert {(r["router"], r["backend"]) for r in rows} == {
        (r, b) for r in ("random", "quillcache", "sglang") for b in ("memory", "native")
    }
    for r in rows:
        assert r["requests"] == 120 and r["ttft_p99_s"] >= r["ttft_p50_s"] > 0
        assert abs(sum(r["worker_share"]) - 1) < 1e-3
    # both backends see the same events, so they must agree on everything
    by = {(r["router"], r["backend"]): r for r in rows}
    for name in ("random", "quillcache", "sglang"):
        mem, nat = dict(by[(name, "memory")]), dict(by[(name, "native")])
        mem.pop("backend"), nat.pop("backend")
        assert mem == nat
    other_seed = json.loads(_sim(*args[:-2], "--seed", "1", "--json", "-").stdout)
    assert other_seed["results"] != rows
    # serial and parallel runs (the default: one process per CPU) give the same
    # results in the same order
    assert _sim(*args, "--jobs", "1").stdout == a
    assert _sim(*args, "--jobs", "3").stdout == a


def _table_without_timings(out: str) -> list[list[str]]:
    """The table's rows minus the last two cells (index match µs, wall s: measured)."""
    rows = [line.split("│")[1:-1] for line in out.splitlines() if line.startswith("│")]
    return [[cell.strip() for cell in row[:-2]] for row in rows]


def test_table_is_the_same_serial_and_parallel() -> None:
    args = [*SMALL, "--routers", "random,quillcache,preble,session-affinity"]
    env = {**os.environ, "COLUMNS": "250"}  # no truncated cells
    serial = _sim(*args, "--jobs", "1", env=env).stdout
    parallel = _sim(*args, "--jobs", "2", env=env).stdout
    rows = _table_without_timings(serial)
    assert [r[0] for r in rows] == ["random", "quillcache", "preble", "session-affinity"]
    assert _table_without_timings(parallel) == rows
    assert serial.splitlines()[0] == parallel.splitlines()[0]  # the title


def test_negative_jobs_is_a_clear_error() -> None:
    proc = _sim(*SMALL, "--jobs", "-1", check=False)
    assert proc.returncode == 2
    assert "--jobs must be >= 0" in proc.stderr


@pytest.mark.slow
def test_trace_capacity_sweep_with_plot(tmp_path) -> None:
    trace = tmp_path / "t.jsonl"
    write_chained_trace(trace, sessions=40)
    png = tmp_path / "plot.png"
    out = tmp_path / "r.json"
    _sim(
        "--trace",
        str(trace),
        "--workers",
        "1",
        "--capacity",
        "4,16,unbounded",
        "--routers",
        "round-robin",
        "--timing",
        "none",
        "--json",
        str(out),
        "--plot",
        str(png),
        "--no-progress",
    )
    rows = json.loads(out.read_text())["results"]
    rates = [r["block_hit_rate"] for r in rows]
    assert [r["capacity_point"] for r in rows] == [4, 16, "unbounded"]
    assert rates == sorted(rates) and rates[-1] > rates[0]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--routers", "nope"], "unknown router 'nope'"),
        (["--backends", "nope"], "unknown index backend 'nope'"),
        (["--capacity", "-3"], "must be positive"),
        (["--trace", "/no/such/file.jsonl"], "cannot read trace"),
        (["--cost", "gpu.nope=1"], "unknown cost-model field"),
        (["--router-opt", "mooncake.bogus=1"], "bogus"),
        (["--no-admission"], "--no-admission needs an SLO"),
        (["--slo-ttft", "-1"], "--slo-ttft must be a positive number"),
        (["--slo-tbt", "nan"], "--slo-tbt must be a positive number"),
        (["--slo-ttft", "2", "--timing", "none"], "an SLO needs --timing full"),
        (["--slo-queue"], "--slo-queue needs --slo-ttft"),
        (["--slo-ttft", "2", "--slo-queue", "--no-admission"], "--slo-queue needs"),
        # each a traceback or a message about something else before
        (["--seed", "-1"], "--seed must be at least 0"),
        (["--rate", "nan"], "--rate must be a positive finite number"),
        (["--time-scale", "nan"], "--time-scale must be a positive finite number"),
        (["--json", "/no/such/dir/r.json"], "the directory /no/such/dir does not exist"),
        (["--gen", "rate=NaN"], "parameter 'rate' must be a finite number above 0"),
        (["--gen", "rate=abc"], "parameter 'rate' must be a number, got 'abc'"),
        (["--gen", "zipf=-1"], "parameter 'zipf' must be a finite number at least 0"),
        (["--output-tokens", "-1"], "'output_tokens' must be a finite number"),
        (["--gen", "turns=3"], "'turns' is not a parameter of shared-prefix; known:"),
        (
            ["--workload", "multi-turn", "--gen", "think_time_s=-5"],
            "'think_time_s' must be a finite number at least 0",
        ),
        (["--workload", "agent-fanout", "--gen", "fanout=2.5"], "must be a whole number"),
        # accepted and ignored, or a run that could serve nothing, before
        (["--cpu-blocks", "-1"], "--cpu-blocks must be at least 0"),
        (["--fresh"], "--fresh needs --matrix"),
        (["--per-block-ids"], "--per-block-ids shape a trace's replay"),
        (["--limit", "5"], "--limit shape a trace's replay"),
        (["--capacity-tokens", "5"], "--capacity-tokens 5 holds no whole block"),
    ],
)
def test_bad_flags_exit_2_with_a_message(args: list[str], needle: str) -> None:
    proc = _sim(*SMALL, *args, check=False)
    assert proc.returncode == 2
    assert needle in proc.stderr
    assert "Traceback" not in proc.stderr


def test_capacities_no_gpu_holds_are_reported_and_warned(tmp_path) -> None:
    from quillcache.costmodel import CostModel

    trace = tmp_path / "t.jsonl"
    write_chained_trace(trace, sessions=10)
    common = ["--trace", str(trace), "--routers", "round-robin", "--jobs", "1", "--no-progress"]
    plausible = _sim(*common, "--capacity", "400", "--json", "-")
    assert "warning" not in plausible.stderr
    doc = json.loads(plausible.stdout)
    assert "warnings" not in doc["meta"]
    row = doc["results"][0]
    assert row["kv_exceeds_gpu"] is False
    assert row["kv_gib_per_engine"] == round(CostModel().kv_gib(400, 512), 2) == 25.0

    out = tmp_path / "r.json"
    huge = _sim(*common, "--capacity", "400,10000", "--json", str(out))
    lines = [ln for ln in huge.stderr.splitlines() if "warning" in ln]
    assert len(lines) == 1  # one clear line, for the one capacity that does not fit
    assert "10,000 KV blocks" in lines[0] and "625.0 GiB" in lines[0]
    doc = json.loads(out.read_text())
    assert doc["meta"]["warnings"] == [lines[0].removeprefix("warning: ")]
    by_cap = {r["capacity_blocks"]: r for r in doc["results"]}
    assert by_cap[10000]["kv_exceeds_gpu"] is True and by_cap[10000]["kv_gib_per_engine"] == 625.0
    assert by_cap[400]["kv_exceeds_gpu"] is False
    assert "625.0!" in huge.stdout  # the table marks it

    # order-only replay is a cache analysis: the memory is reported, nobody is warned
    none = _sim(*common, "--capacity", "10000", "--timing", "none", "--json", "-")
    assert "warning" not in none.stderr
    assert json.loads(none.stdout)["results"][0]["kv_exceeds_gpu"] is True


def test_a_trace_refuses_the_flags_of_a_generated_workload(tmp_path) -> None:
    """They would be ignored: the whole trace replayed whatever `--requests` said."""
    trace = tmp_path / "t.jsonl"
    write_chained_trace(trace, sessions=4)
    common = ["--trace", str(trace), "--routers", "round-robin", "--no-progress"]
    for extra, named in (
        (["--requests", "5"], "--requests"),
        (["--workload", "multi-turn", "--gen", "turns=2"], "--workload, --gen"),
    ):
        proc = _sim(*common, *extra, check=False)
        assert proc.returncode == 2, proc.stderr
        assert f"{named} shape a generated workload, not a trace" in proc.stderr
    assert _sim(*common, "--limit", "3", "--time-scale", "2").returncode == 0
