"""Gateway replicas on the Mooncake trace (issue 16 §3): every built-in router at
N = 1, 2, 4, 8 replicas for each replica state, as one `quillcache simulate` command.

    python -m benchmarks.replicas.sweep [--trace PATH] [--limit 0] [--workers 8]
        [--replicas 1,2,4,8] [--states shared,private,approximate] [--routers all]
        [--lb round-robin] [--jobs 0] [--json out.json] [--plot sim-replicas.png]
        [--from-json out.json]

Runs `quillcache simulate --replicas ... --replica-state ...` once (every point of the
sweep in one process pool) and prints the command, its wall time and the host's load,
then markdown for docs/results/simulator.md:

- per state, a table of routers x N, each cell: engine block hit rate · TTFT p50 / p99
  · routing precision (the share of decisions equal to the shadow single gateway's);
- at the largest N, a table of the states side by side per router;
- the checks below, with what failed.

Checks: with one replica, `shared` and `private` state know everything one gateway
knows, so their precision must be 1.0 for every router (a failure is a simulator bug:
exit status 1); at every N, `shared` precision should be at least `private`'s, and
`private`'s at least `approximate`'s (a warning: randomised routers can differ by
chance).

`--plot` draws hit rate, TTFT p50 and precision against N, one panel row per state,
one line per router. Plots are not committed (`*.png` is gitignored outside
docs/img/): write it outside the tree or at the repo root. `--from-json` formats an
earlier run's JSON (the simulator's `--json`) instead of simulating.

Default: the whole trace (12,031 requests), 8 workers, every router: 144 runs, 5-6 s
each at 8 replicas (9 indexes apply every event: 8 replicas and the shadow); 445 s of
wall time on the shared 2-core development host with the default one process per CPU
(2026-12-05, load average 0.3-3.7), inside the 20-minute budget, so no `--limit`.
`--limit 3000` is a quarter of the work for a quick look.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: The shared trace, next to the repository (as `quillcache.bench.workloads`).
TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/traces/mooncake_conversation_trace.jsonl"
)
STATES = ("shared", "private", "approximate")

Result = dict[str, Any]


def command(args: argparse.Namespace, out: Path) -> list[str]:
    """The `quillcache simulate` command line of the sweep (what the page quotes)."""
    cmd = ["quillcache", "simulate", "--trace", _shown(args.trace)]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    cmd += [
        "--workers",
        str(args.workers),
        "--routers",
        args.routers,
        "--replicas",
        args.replicas,
        "--replica-state",
        args.states,
        "--lb",
        args.lb,
        "--jobs",
        str(args.jobs),
        "--no-progress",
        "--json",
        str(out),
    ]
    return cmd


def _shown(path: str | Path) -> str:
    """A path as short as it can be said from here (relative when under the parent)."""
    rel = os.path.relpath(path)
    return rel if len(rel) < len(str(path)) else str(path)


def simulate(args: argparse.Namespace, out: Path) -> tuple[list[str], float]:
    cmd = command(args, out)
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "quillcache", *cmd[1:]], check=True, stdout=subprocess.DEVNULL
    )
    return cmd, time.perf_counter() - t0


def _index(
    results: Sequence[Result],
) -> tuple[dict[tuple[str, str, int], Result], list[str], list[str], list[int]]:
    """Results by (state, router, N), and the states, routers and Ns in run order."""
    by: dict[tuple[str, str, int], Result] = {}
    for r in results:
        by[r["replica_state"], r["router"], int(r["replicas"])] = r
    states = list(dict.fromkeys(r["replica_state"] for r in results))
    routers = list(dict.fromkeys(r["router"] for r in results))
    counts = sorted({int(r["replicas"]) for r in results})
    return by, states, routers, counts


def cell(r: Result) -> str:
    """hit · TTFT p50 / p99 · precision."""
    return (
        f"{r['block_hit_rate'] * 100:.1f} % · {r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.1f} s · "
        f"{r['routing_precision']:.2f}"
    )


def tables(results: Sequence[Result]) -> str:
    """One markdown table per state: routers x replica counts."""
    by, states, routers, counts = _index(results)
    out = []
    for state in states:
        out.append(f"**{state}** (block hit · TTFT p50 / p99 · routing precision)\n")
        out.append("| router | " + " | ".join(f"N = {n}" for n in counts) + " |")
        out.append("|---|" + "---:|" * len(counts))
        for router in routers:
            cells = [
                cell(by[state, router, n]) if (state, router, n) in by else "-" for n in counts
            ]
            out.append(f"| {router} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def side_by_side(results: Sequence[Result], n: int | None = None) -> str:
    """At N replicas (default: the largest), per router: precision, block hit rate and
    TTFT p50 / p99, each as the states' values in run order (shared / private /
    approximate by default)."""
    by, states, routers, counts = _index(results)
    n = counts[-1] if n is None else n
    order = " / ".join(states)
    out = [
        f"**N = {n}**, each cell {order}\n",
        "| router | routing precision | block hit (%) | TTFT p50 (s) | TTFT p99 (s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for router in routers:
        row = [router]
        for key, fmt in (
            ("routing_precision", "{:.2f}"),
            ("block_hit_rate", "{:.1f}"),
            ("ttft_p50_s", "{:.2f}"),
            ("ttft_p99_s", "{:.1f}"),
        ):
            scale = 100.0 if key == "block_hit_rate" else 1.0
            vals = [by.get((s, router, n)) for s in states]
            row.append(" / ".join(fmt.format(r[key] * scale) if r else "-" for r in vals))
        out.append("| " + " | ".join(row) + " |")
    out.append("")
    return "\n".join(out)


def checks(results: Sequence[Result], tolerance: float = 0.02) -> tuple[list[str], list[str]]:
    """(errors, warnings). Errors: one `shared` or `private` replica whose precision
    is not 1.0 (it knows what one gateway knows). Warnings: at some N, a router whose
    precision is lower with more shared state (shared < private or private <
    approximate, by more than `tolerance`)."""
    by, _, routers, counts = _index(results)
    errors: list[str] = []
    warnings: list[str] = []
    for router in routers:
        for state in ("shared", "private"):
            r = by.get((state, router, 1))
            if r is not None and r["routing_precision"] != 1.0:
                errors.append(
                    f"{router}, 1 {state} replica: precision {r['routing_precision']} != 1.0"
                )
        for n in counts:
            for more, less in (("shared", "private"), ("private", "approximate")):
                a, b = by.get((more, router, n)), by.get((less, router, n))
                if a is None or b is None:
                    continue
                if a["routing_precision"] + tolerance < b["routing_precision"]:
                    warnings.append(
                        f"{router}, N = {n}: {more} precision {a['routing_precision']:.3f} "
                        f"< {less} {b['routing_precision']:.3f}"
                    )
    return errors, warnings


def plot(results: Sequence[Result], path: str, title: str) -> None:
    from quillcache.plotting import pyplot

    plt = pyplot()
    _, states, routers, counts = _index(results)
    metrics = [
        ("block_hit_rate", "block hit rate (%)", 100.0, False),
        ("ttft_p50_s", "TTFT p50 (s)", 1.0, True),
        ("routing_precision", "routing precision", 1.0, False),
    ]
    fig, axes = plt.subplots(
        len(states), len(metrics), figsize=(15, 3.6 * len(states)), squeeze=False
    )
    cmap = plt.get_cmap("tab20")
    for i, state in enumerate(states):
        for j, (key, label, scale, log) in enumerate(metrics):
            ax = axes[i][j]
            for k, router in enumerate(routers):
                pts = sorted(
                    (int(r["replicas"]), r[key] * scale)
                    for r in results
                    if r["replica_state"] == state and r["router"] == router
                )
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker="os^Dv"[k % 5],
                    color=cmap(k),
                    label=router,
                )
            ax.set_xscale("log", base=2)
            ax.set_xticks(counts)
            ax.set_xticklabels([str(c) for c in counts])
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{state}: {label}")
            ax.set_xlabel("gateway replicas")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(data: dict[str, Any]) -> tuple[str, int]:
    """The tables and checks for a simulator JSON; exit status 1 on a check error."""
    results = data["results"]
    if not results or "routing_precision" not in results[0]:
        raise SystemExit("no replica results in this JSON (was it run with --replicas?)")
    errors, warnings = checks(results)
    parts = [tables(results), side_by_side(results)]
    parts.append("checks: " + ("all passed" if not errors and not warnings else ""))
    parts += [f"- ERROR {e}" for e in errors] + [f"- warning {w}" for w in warnings]
    return "\n".join(parts) + "\n", 1 if errors else 0


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.replicas.sweep", description=__doc__.split("\n")[0]
    )
    p.add_argument("--trace", default=str(TRACE), help="a Mooncake-format trace (the shared one)")
    p.add_argument("--limit", type=int, default=0, help="only the first N requests (0: all)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--replicas", default="1,2,4,8")
    p.add_argument("--states", default=",".join(STATES))
    p.add_argument("--routers", default="all")
    p.add_argument("--lb", default="round-robin", help="round-robin or random")
    p.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    p.add_argument("--json", help="keep the simulator's JSON here")
    p.add_argument("--plot", help="PNG: hit rate, TTFT p50 and precision against N")
    p.add_argument("--from-json", help="format this earlier JSON instead of simulating")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
    else:
        if not Path(args.trace).is_file():
            print(f"no trace at {args.trace} (--trace PATH)", file=sys.stderr)
            return 2
        load0 = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(args.json) if args.json else Path(tmp) / "replicas.json"
            cmd, wall = simulate(args, out)
            data = json.loads(out.read_text())
        load1 = os.getloadavg()[0]
        print(
            f"`{shlex.join(cmd)}`: {len(data['results'])} runs, {wall:.0f} s wall, "
            f"load average {load0:.1f} at the start, {load1:.1f} at the end\n"
        )
    text, status = report(data)
    print(text)
    if args.plot:
        meta = data["meta"]
        plot(
            data["results"],
            args.plot,
            f"{meta['workload']}, {meta['requests']} requests, "
            f"{data['results'][0]['workers']} workers, LB {meta['replicas']['lb']}",
        )
        print(f"plot: {args.plot}")
    return status


if __name__ == "__main__":
    sys.exit(main())
