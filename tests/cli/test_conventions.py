"""What every command owes a user at the shell: `--json -` is JSON alone on stdout,
tables written to a pipe keep their width, a missing optional extra is named, a user's
router class works in `simulate` as in the gateway, a work directory is created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SMALL_SIM = ["--requests", "60", "--prefix-groups", "3", "--no-progress", "--timing", "none"]
SMALL_BENCH = ["--workload", "synthetic", "--requests", "200", "--queries", "100"]


def quillcache(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    """The CLI in a fresh interpreter; `prelude` runs first (e.g. to hide a module)."""
    code = f"{prelude}\nimport sys\nfrom quillcache.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_bench_index_json_to_stdout_is_json_alone_and_creates_its_workdir(tmp_path: Path) -> None:
    workdir = tmp_path / "not" / "yet"
    proc = quillcache(
        "bench-index", "--backend", "native", *SMALL_BENCH, "--json", "-", "--workdir", str(workdir)
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)  # nothing but the JSON
    assert report["results"][0]["backend"] == "native"
    assert "bench-index synthetic" in proc.stderr  # the table went to stderr
    assert workdir.is_dir()


def test_simulate_json_to_stdout_is_json_alone() -> None:
    proc = quillcache("simulate", *SMALL_SIM, "--routers", "round-robin", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["results"][0]["router"] == "round-robin"


def test_tables_written_to_a_pipe_are_not_cut_to_80_columns() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_index.py", "--backends", "native", "--blocks", "20000"],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "…" not in proc.stdout
    assert max(len(line) for line in proc.stdout.splitlines()) > 80  # one line per row
    assert any(line.count("│") > 5 and "native" in line for line in proc.stdout.splitlines())


def test_a_table_wider_than_any_terminal_is_kept_whole(capsys: object) -> None:
    from rich.table import Table

    from quillcache.console import table_console

    t = Table()
    for i in range(30):
        t.add_column(f"column {i}")
    t.add_row(*(f"{1_000_000 + i:,}" for i in range(30)))
    table_console().print(t)  # stdout is captured: not a terminal
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "…" not in out and "1,000,029" in out
    assert sum(1 for line in out.splitlines() if "1,000,000" in line) == 1


def test_simulate_takes_a_users_router_class_as_the_gateway_does() -> None:
    spec = "tests.online.custom_router:HighestWorker"
    proc = quillcache("simulate", *SMALL_SIM, "--routers", f"round-robin,{spec}", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    routers = [r["router"] for r in json.loads(proc.stdout)["results"]]
    assert routers == ["round-robin", "highest-worker"]
    bad = quillcache("simulate", *SMALL_SIM, "--routers", "no.such.module:Router")
    assert bad.returncode == 2 and "cannot import" in bad.stderr


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    hide = "import sys; sys.modules['matplotlib'] = None"
    for args in (
        ["simulate", *SMALL_SIM, "--plot", str(tmp_path / "a.png")],
        ["bench-index", "--backend", "native", *SMALL_BENCH, "--plot", str(tmp_path / "b.png")],
    ):
        proc = quillcache(*args, prelude=hide)
        assert proc.returncode == 2, proc.stderr
        assert "quillcache[plot]" in proc.stderr and "Traceback" not in proc.stderr
