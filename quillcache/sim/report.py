"""Comparison table (rich) and plots (matplotlib, Agg) of simulation results."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: list[dict[str, Any]], meta: dict[str, Any], *, sweep_workers: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    full = meta["timing"] == "full"
    sweep_cap = any("capacity_point" in r for r in results)
    t = Table(
        title=f"{meta['workload']}: {meta['requests']} requests, "
        f"block size {meta['block_size']}, timing {meta['timing']}",
        title_justify="left",
    )
    cols = ["router", "backend"]
    if sweep_workers:
        cols.append("workers")
    if sweep_cap:
        cols.append("capacity")
    cols += ["block hit", "token hit", "prefill tok"]
    if full:
        cols += ["TTFT mean", "p50", "p99", "E2E mean", "req/s"]
    cols += ["rejected", "share CV", "match µs", "wall s"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("router", "backend") else "right")
    for r in results:
        row = [r["router"], r["backend"]]
        if sweep_workers:
            row.append(str(r["workers"]))
        if sweep_cap:
            row.append(str(r.get("capacity_point", r["capacity_blocks"])))
        row += [
            _f(r["block_hit_rate"] * 100, ".1f") + "%",
            _f(r["token_hit_rate"] * 100, ".1f") + "%",
            f"{r['prefill_tokens_computed']:,}",
        ]
        if full:
            row += [
                _f(r["ttft_mean_s"], ".3f"),
                _f(r["ttft_p50_s"], ".3f"),
                _f(r["ttft_p99_s"], ".3f"),
                _f(r["e2e_mean_s"], ".2f"),
                _f(r["throughput_rps"], ".2f"),
            ]
        row += [
            str(r["rejected"]),
            _f(r["worker_share_cv"], ".3f"),
            _f(r.get("match_us_mean"), ".1f"),
            _f(r.get("wall_s"), ".2f"),
        ]
        t.add_row(*row)
    console = Console()
    if not console.is_terminal:
        console = Console(width=200)
    console.print(t)


def plot(results: list[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Hit rate and TTFT per router; with a capacity sweep, hit rate vs capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in results if "capacity_point" in r]
    has_ttft = any(r.get("ttft_mean_s") is not None for r in results)
    panels = 1 + int(has_ttft) + int(bool(sweep))
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5), squeeze=False)
    ax_list = list(axes[0])
    labels = [
        f"{r['router']}\n{r['backend']}"
        + (f"\ncap {r['capacity_point']}" if "capacity_point" in r else "")
        + (f"\n{r['workers']} workers" if len({x["workers"] for x in results}) > 1 else "")
        for r in results
    ]
    ax = ax_list.pop(0)
    ax.bar(range(len(results)), [r["block_hit_rate"] * 100 for r in results])
    ax.set_xticks(range(len(results)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("block hit rate (%)")
    ax.set_title("hit rate per router")
    if has_ttft:
        ax = ax_list.pop(0)
        ax.bar(range(len(results)), [r.get("ttft_mean_s") or 0.0 for r in results])
        ax.set_xticks(range(len(results)), labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("mean TTFT (s)")
        ax.set_title("TTFT per router")
    if sweep:
        ax = ax_list.pop(0)
        by_router: dict[str, list[tuple[float, float]]] = {}
        finite = [r["capacity_point"] for r in sweep if r["capacity_point"] != "unbounded"]
        top = max(finite) * 2 if finite else 1
        for r in sweep:
            cap = r["capacity_point"]
            x = top if cap == "unbounded" else cap
            by_router.setdefault(f"{r['router']}/{r['backend']}", []).append(
                (x, r["block_hit_rate"] * 100)
            )
        for name, pts in by_router.items():
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("KV capacity per worker (blocks; rightmost = unbounded)")
        ax.set_ylabel("block hit rate (%)")
        ax.set_title("hit rate vs capacity")
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
