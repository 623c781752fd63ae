"""`quillcache simulate --matrix GRID [--out DIR] [--jobs N] [--ray WHERE] [--fresh]`: run
a grid, write DIR/matrix.json, DIR/matrix.md and DIR/matrix-heatmap.png (docs/simulator.md,
"The matrix"), keeping each run in DIR/runs.jsonl as it finishes, so the same command
resumes a grid that was stopped. Exits 1 when a run failed (its cell lists the error), 2
on a bad grid or a checkpoint of another grid."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

from quillcache.errors import ConfigError

# simulate's options that a matrix run takes; the grid file sets everything else
_MATRIX_OPTIONS = {
    "matrix",
    "out",
    "fresh",
    "jobs",
    "no_progress",
    "json",
    "plot",
    "perf",
    "ray",
}
#: Without a terminal, a progress line at most this often (and one at the end).
PROGRESS_EVERY_S = 60.0


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
    if args.fresh and not args.matrix:
        raise ConfigError("--fresh needs --matrix")


class ProgressLines:
    """Progress as plain lines on stderr for runs without a terminal (CI, nohup, a
    batch system): done / total, the share, the wall time so far and a rough time left
    from this invocation's pace; at most one line per `every_s`, and the last."""

    def __init__(self, err: Any, resumed: int, every_s: float = PROGRESS_EVERY_S) -> None:
        self.err = err
        self.resumed = resumed
        self.every_s = every_s
        self.t0 = time.monotonic()
        self.last = self.t0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        wall = now - self.t0
        ran = done - self.resumed
        left = ""
        if ran > 0 and done < total:
            left = f", about {wall / ran * (total - done):,.0f} s left"
        self.err.print(
            f"matrix: {done:,} of {total:,} runs ({done / total:.0%}), {wall:,.0f} s{left}",
            highlight=False,
        )


def run(args: argparse.Namespace, err: Any) -> int:
    from rich.progress import Progress

    from quillcache.sim.cli import check_output_paths, usable_cpus
    from quillcache.sim.matrix import execute, load_grid, results_json, tasks_of
    from quillcache.sim.matrix_checkpoint import CHECKPOINT_NAME, Checkpoint
    from quillcache.sim.matrix_report import heatmap, page

    check_output_paths(args.json, args.plot)
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
    checkpoint = Checkpoint.open(out / CHECKPOINT_NAME, grid, fresh=args.fresh)
    if checkpoint.resumed:
        err.print(
            f"resuming: {checkpoint.resumed:,} of {n:,} runs already done in "
            f"{checkpoint.path} (--fresh: start over)"
        )
    if checkpoint.dropped_partial_line:
        err.print(f"note: dropped a run cut short while being written to {checkpoint.path}")
    bar_shown = not args.no_progress and err.is_terminal
    lines = None if args.no_progress or bar_shown else ProgressLines(err, checkpoint.resumed)
    try:
        with Progress(console=err, disable=not bar_shown, transient=True) as bar:
            task = bar.add_task("matrix", total=n, completed=checkpoint.resumed)

            def progress(done: int, total: int) -> None:
                bar.update(task, completed=done)
                if lines is not None:
                    lines(done, total)

            outcome = execute(
                grid, jobs=jobs, progress=progress, ray=args.ray, checkpoint=checkpoint
            )
    finally:
        checkpoint.close()
    results = results_json(grid, outcome)
    ran_on = (
        f"{outcome.jobs} process{'es' if outcome.jobs > 1 else ''}"
        if outcome.where == "local"
        else f"{outcome.where} ({outcome.jobs} CPUs)"
    )
    timing = (
        f"CPU time {outcome.cpu_s:,.0f} s over the runs; wall {outcome.wall_s:,.0f} s on {ran_on}"
        + (
            f" for the {n - outcome.resumed:,} runs not resumed from {CHECKPOINT_NAME}."
            if outcome.resumed
            else "."
        )
    )
    if args.perf:
        results["perf"] = {
            "cpu_s": round(outcome.cpu_s, 1),
            "wall_s": round(outcome.wall_s, 1),
            "jobs": outcome.jobs,
            "resumed": outcome.resumed,
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
