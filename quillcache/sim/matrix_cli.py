"""`quillcache simulate --matrix GRID [--out DIR] [--jobs N] [--ray WHERE]`: run a grid,
write DIR/matrix.json, DIR/matrix.md and DIR/matrix-heatmap.png (docs/simulator.md, "The
matrix"). Exits 1 when a run failed (its cell lists the error), 2 on a bad grid."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

from quillcache.errors import ConfigError

# simulate's options that a matrix run takes; the grid file sets everything else
_MATRIX_OPTIONS = {"matrix", "out", "jobs", "no_progress", "json", "plot", "perf", "ray"}


def check_options(args: argparse.Namespace, defaults: dict[str, Any]) -> None:
    """Refuse the single-run options (workload, cluster, cost model...) with --matrix:
    the grid file says them, and a flag silently ignored would be a wrong answer."""
    given = [
        k
        for k, v in vars(args).items()
        if k not in _MATRIX_OPTIONS and k in defaults and v != defaults[k]
    ]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(given))
        raise ConfigError(f"{flags}: not taken with --matrix (the grid file sets the runs)")
    if args.out is not None and not args.matrix:
        raise ConfigError("--out needs --matrix")
    if args.ray is not None and not args.matrix:
        raise ConfigError("--ray needs --matrix")


def run(args: argparse.Namespace, err: Any) -> int:
    from rich.progress import Progress

    from quillcache.sim.cli import usable_cpus
    from quillcache.sim.matrix import execute, load_grid, results_json, tasks_of
    from quillcache.sim.matrix_report import heatmap, page

    grid = load_grid(args.matrix)
    jobs = args.jobs or usable_cpus()
    out = Path(args.out or f"matrix-{grid.name}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out {out}: {exc.strerror or exc}") from None
    plot_path = Path(args.plot) if args.plot else out / "matrix-heatmap.png"
    want_plot = True
    try:
        from quillcache.plotting import pyplot

        pyplot()
    except ConfigError as exc:
        if args.plot:
            raise
        want_plot = False
        err.print(f"[yellow]note:[/yellow] no heatmap: {exc}")
    n = len(tasks_of(grid))
    where = f"on Ray ({args.ray})" if args.ray is not None else f"{min(jobs, n)} processes"
    err.print(
        f"grid {grid.name}: {len(grid.cells)} cells x {len(grid.routers)} routers x "
        f"{len(grid.seeds)} seeds = {n} runs, {where}"
    )
    show = not args.no_progress and err.is_terminal
    with Progress(console=err, disable=not show, transient=True) as bar:
        task = bar.add_task("matrix", total=n)
        outcome = execute(
            grid,
            jobs=jobs,
            progress=lambda done, total: bar.update(task, completed=done),
            ray=args.ray,
        )
    results = results_json(grid, outcome)
    ran_on = (
        f"{outcome.jobs} process{'es' if outcome.jobs > 1 else ''}"
        if outcome.where == "local"
        else f"{outcome.where} ({outcome.jobs} CPUs)"
    )
    timing = (
        f"CPU time {outcome.cpu_s:,.0f} s over the runs; wall {outcome.wall_s:,.0f} s on {ran_on}."
    )
    if args.perf:
        results["perf"] = {
            "cpu_s": round(outcome.cpu_s, 1),
            "wall_s": round(outcome.wall_s, 1),
            "jobs": outcome.jobs,
            "cell_cpu_s": [round(x, 2) for x in outcome.cell_cpu_s(grid)],
        }
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    json_path = args.json or str(out / "matrix.json")
    if json_path == "-":
        sys.stdout.write(text)
    else:
        Path(json_path).write_text(text)
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    command = (
        "quillcache simulate --matrix "
        + args.matrix
        + (f" --jobs {args.jobs}" if args.jobs else "")
        + (f" --ray {args.ray}" if args.ray is not None else "")
    )
    md = page(
        results,
        title=f"Matrix `{grid.name}` ({today})",
        command=command,
        timing=timing,
        cell_cpu_s=outcome.cell_cpu_s(grid),
    )
    (out / "matrix.md").write_text(md + "\n")
    if want_plot:
        heatmap(results, plot_path, title=f"grid {grid.name}: TTFT over each cell's best router")
    for metric in ("mean", "p99"):
        shown = ", ".join(f"{k} {v}" for k, v in results["totals"][metric].items())
        err.print(f"quillcache on {metric} TTFT: {shown}")
    err.print(timing)
    err.print(
        f"written: {out / 'matrix.md'}, {json_path}" + (f", {plot_path}" if want_plot else "")
    )
    failures = outcome.failures
    if failures:
        err.print(f"[red]{len(failures)} of {n} runs failed[/red] (their cells say why):")
        for message in failures[:10]:
            err.print(f"  {message}")
        return 1
    return 0
