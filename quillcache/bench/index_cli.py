"""`quillcache bench-index`: every index backend on the same workload, side by side.

    quillcache bench-index --backend native,native-wal,rocksdb --workload seed --json out.json

Reports per backend: ingest (blocks/s, events/s), match p50/p99 (the routing query:
longest cached prefix per worker), subtree-scan p50/p99, recovery time after SIGKILL
and after a clean close, bytes on disk, bytes written per block stored (measured from
/proc/self/io), resident memory. Each backend runs in its own process.
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOADS = ("seed", "synthetic", "mooncake")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default="memory,native,native-wal,rocksdb,holt",
        help="comma-separated index backends (any registered one: see "
        "quillcache.index.backend_status()); unavailable ones are reported and skipped",
    )
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="seed",
        help="seed: the original ART-vs-LSM study's; mooncake: the shared trace; synthetic",
    )
    parser.add_argument("--queries", type=int, default=20_000, help="match and scan queries")
    parser.add_argument("--requests", type=int, default=20_000, help="synthetic: requests")
    parser.add_argument("--workers", type=int, default=8, help="synthetic/mooncake: workers")
    parser.add_argument(
        "--capacity",
        type=int,
        default=None,
        help="blocks per worker LRU (default: synthetic 50,000; mooncake 10,000)",
    )
    parser.add_argument("--trace", type=Path, default=None, help="mooncake trace (JSONL)")
    parser.add_argument("--durability", default="interval:10", help="native-wal durability")
    parser.add_argument(
        "--snapshot-min-mib",
        type=float,
        default=4.0,
        help="native-wal: log MiB that trigger a snapshot at least (snapshot_every_bytes)",
    )
    parser.add_argument(
        "--snapshot-log-ratio",
        type=float,
        default=0.125,
        help="native-wal: or this x the last snapshot's size, if larger",
    )
    parser.add_argument("--chunk", type=int, default=64, help="event batches per apply call")
    parser.add_argument("--json", metavar="PATH", help="write results as JSON ('-' for stdout)")
    parser.add_argument("--plot", metavar="PATH", help="write a bar chart (PNG) of the results")
    parser.add_argument("--workdir", type=Path, default=None, help="where the indexes live")
    parser.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds per backend phase; a slower backend is reported as such (0 = none)",
    )


def build_workload(args: argparse.Namespace, progress: Any) -> Any:
    from quillcache.bench import workloads as W
    from quillcache.errors import ConfigError

    if args.workload == "seed":
        task = progress.add_task("building seed workload", total=2000)
        return W.seed(args.queries, lambda n: progress.advance(task, n))
    if args.workload == "synthetic":
        task = progress.add_task("building synthetic workload", total=args.requests)
        return W.synthetic(
            args.requests,
            args.workers,
            args.capacity or 50_000,
            args.queries,
            progress=lambda n: progress.advance(task, n),
        )
    trace = args.trace or W.DEFAULT_TRACE
    if not trace.exists():
        raise ConfigError(f"mooncake trace not found at {trace}; pass --trace PATH")
    reqs = W.mooncake_requests(trace)
    task = progress.add_task("building mooncake workload", total=len(reqs))
    return W.mooncake(
        trace,
        args.workers,
        args.capacity or 10_000,
        args.queries,
        progress=lambda n: progress.advance(task, n),
        requests=reqs,
    )


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f} M" if x >= 1e6 else f"{x / 1e3:.1f} k"


def _fmt_bytes(x: float | None) -> str:
    if x is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= div:
            return f"{x / div:.1f} {unit}"
    return f"{x:.0f} B"


def _fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f} ms"


def render_table(results: list[dict[str, Any]], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col in (
        "backend",
        "ingest blocks/s",
        "events/s",
        "match p50",
        "match p99",
        "scan p50",
        "scan p99",
        "recovery (kill)",
        "recovery (clean)",
        "on disk",
        "written/block",
        "RSS",
    ):
        t.add_column(col, justify="left" if col == "backend" else "right")
    for r in results:
        if "skipped" in r:
            failed = r["skipped"].startswith("failed")
            t.add_row(
                r["backend"], "[red]failed[/red]" if failed else "[dim]skipped[/dim]", *[""] * 10
            )
            continue
        t.add_row(
            r["backend"],
            _fmt_rate(r["blocks_per_s"]),
            _fmt_rate(r["events_per_s"]),
            f"{r['match']['p50_us']:.1f} µs",
            f"{r['match']['p99_us']:.1f} µs",
            f"{r['scan']['p50_us']:.1f} µs",
            f"{r['scan']['p99_us']:.1f} µs",
            _fmt_ms(r.get("recovery_kill_s")),
            _fmt_ms(r.get("recovery_clean_s")),
            _fmt_bytes(r.get("disk_bytes")),
            "-" if "write_bytes_per_block" not in r else f"{r['write_bytes_per_block']:.0f} B",
            _fmt_bytes(r["rss_bytes"]),
        )
    return t


def plot(results: list[dict[str, Any]], path: str, title: str) -> None:
    from quillcache.plotting import pyplot

    plt = pyplot()

    rows = [r for r in results if "skipped" not in r]
    names = [r["backend"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [r["blocks_per_s"] for r in rows])
    axes[0].set_title("ingest (blocks/s)")
    axes[0].set_yscale("log")
    for i, key in ((1, "match"), (2, "scan")):
        x = range(len(rows))
        axes[i].bar([v - 0.2 for v in x], [r[key]["p50_us"] for r in rows], 0.4, label="p50")
        axes[i].bar([v + 0.2 for v in x], [r[key]["p99_us"] for r in rows], 0.4, label="p99")
        axes[i].set_xticks(list(x), names)
        axes[i].set_title(f"{key} latency (µs)")
        axes[i].set_yscale("log")
        axes[i].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from quillcache.bench.backends import available
    from quillcache.bench.runner import BenchError, environment, run_backend
    from quillcache.console import table_console

    console = Console(stderr=True)
    if args.plot:
        from quillcache.plotting import pyplot

        pyplot()  # before the work: a missing extra is said at once
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    names = [b.strip() for b in args.backend.split(",") if b.strip()]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results: list[dict[str, Any]] = []
    report_error = False
    with Progress(console=console, transient=True) as progress:
        workload = build_workload(args, progress)
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(workload, f)
            wfile = Path(f.name)
        try:
            task = progress.add_task("backends", total=len(names))
            for name in names:
                ok, why = available(name)
                progress.update(task, description=f"benchmarking {name}")
                if not ok:
                    results.append({"backend": name, "skipped": why})
                else:
                    options = {
                        "durability": args.durability,
                        "chunk": args.chunk,
                        "snapshot_every_bytes": int(args.snapshot_min_mib * (1 << 20)),
                        "snapshot_log_ratio": args.snapshot_log_ratio,
                    }
                    try:
                        results.append(
                            run_backend(name, wfile, options, args.workdir, args.timeout or None)
                        )
                    except BenchError as err:
                        results.append({"backend": name, "skipped": f"failed: {err}"})
                progress.advance(task)
        finally:
            wfile.unlink(missing_ok=True)
    title = (
        f"bench-index {args.workload}: {workload.blocks:,} blocks stored in "
        f"{len(workload.batches):,} batches, {workload.resident_blocks:,} resident, "
        f"{len(workload.queries):,} queries"
    )
    done = [r for r in results if "skipped" not in r]
    for key in ("matched_blocks_total", "scanned_entries_total"):
        if len({r[key] for r in done}) > 1:
            detail = ", ".join(f"{r['backend']}={r[key]}" for r in done)
            console.print(f"[bold red]backends disagree on {key}: {detail}[/bold red]")
            report_error = True
    out = table_console(json_on_stdout=args.json == "-")
    out.print(render_table(results, title))
    for r in results:
        if "skipped" in r:
            reason = r["skipped"]
            label = reason if reason.startswith("failed") else f"skipped: {reason}"
            out.print(f"[dim]{r['backend']}: {label}[/dim]")
    report = {
        "command": " ".join(["quillcache", "bench-index", *sys.argv[2:]]),
        "date": started,
        "workload": {
            "name": workload.name,
            "description": workload.description,
            "blocks": workload.blocks,
            "events": workload.events,
            "batches": len(workload.batches),
            "resident_blocks": workload.resident_blocks,
            "queries": len(workload.queries),
        },
        "environment": environment(),
        "results": results,
    }
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)
    if args.plot:
        plot(results, args.plot, title)
    return 1 if report_error else 0
