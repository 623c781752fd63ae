"""The matrix's results page (markdown) and heatmap (matplotlib) from its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

_VERDICT = {
    "best": "best",
    "within_spread": "within the winner's spread",
    "loses": "**loses**",
    "rejects": "**rejects requests**",
    "failed": "**failed** (see the cell)",
}


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f} %"


def _tokens(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _loss(v: dict[str, Any]) -> str:
    verdict = _VERDICT.get(v["verdict"], v["verdict"])
    pct = v.get("own_vs_best_pct")
    if v["verdict"] in ("loses", "within_spread") and pct is not None:
        return f"{verdict} ({pct:+.1f} % vs {v['winner']})"
    return verdict


#: A cell's policy metrics (`matrix.summarize`), shown when its runs have them.
_POLICY_COLUMNS = (
    ("followup_reuse_share", "follow-up reuse"),
    ("followup_ttft_mean_s", "follow-up TTFT (s)"),
    ("retention_touches", "touches"),
    ("retention_prefill_pct", "touch prefill"),
    ("replications", "replicas"),
    ("replication_prefill_pct", "replica prefill"),
    ("slo_met_share", "SLO met"),
    ("slo_goodput_share", "goodput"),
)


def _policy_value(key: str, x: float | None) -> str:
    if x is None:
        return "-"
    if key.endswith("_share"):
        return _share(x)
    if key.endswith("_pct"):
        return f"{x:.1f} %"
    if key.endswith("_s"):
        return _s(x)
    return f"{x:,.0f}"


def page(
    results: dict[str, Any],
    *,
    title: str,
    command: str,
    timing: str,
    cell_cpu_s: list[float] | None = None,
) -> str:
    """The results page: a summary, the cells QuillCache's policy loses, then per cell
    every router's mean and p99 TTFT (mean over seeds, ± their max - min)."""
    meta = results["meta"]
    cells = results["cells"]
    own = meta["own_router"]
    lines = [
        f"## {title}",
        "",
        f"`{command}`: grid `{meta['grid']}` ({meta['description']}); {len(cells)} cells, "
        f"routers: {', '.join(meta['routers'])}; seeds {', '.join(map(str, meta['seeds']))}. "
        f"{timing}",
        "",
        "Workloads: " + "; ".join(f"`{n}` = {d}" for n, d in meta["workloads"].items()) + ".",
        "",
        f"Each value is the mean over the seeds; ± is the seeds' max - min. The winner has the "
        f"lowest mean among routers that rejected no request. `{own}` is judged *best*, "
        "*within the winner's spread* (its mean ≤ the winner's mean + the winner's spread), "
        "or *loses*. KV-optimal: the share of requests placed on an engine holding the "
        "longest usable prefix among the routable ones; regret: the prefill tokens per request "
        "such an engine held that the chosen one did not (mean over the seeds; "
        "docs/simulator.md).",
        "",
    ]
    for metric, label in (("mean", "mean TTFT"), ("p99", "p99 TTFT")):
        totals = results["totals"][metric]
        shown = ", ".join(f"{_VERDICT.get(k, k).strip('*')} {n}" for k, n in totals.items())
        lines.append(f"- `{own}` on {label}: {shown} (of {len(cells)} cells)")
    lines += ["", f"### Where `{own}` loses", ""]
    losses = [
        (c, m) for c in cells for m in ("mean", "p99") if c[m]["verdict"] in ("loses", "rejects")
    ]
    if losses:
        lines += [
            "| cell | metric | winner | winner (s) | own (s) | own vs winner |",
            "|---|---|---|---:|---:|---:|",
        ]
        for c, m in losses:
            v = c[m]
            pct = v.get("own_vs_best_pct")
            lines.append(
                f"| {c['name']} | {m} TTFT | {v['winner']} | {_s(v.get('best_s'))} | "
                f"{_s(v.get('own_s'))} | {'-' if pct is None else f'{pct:+.1f} %'} |"
            )
    elif own not in meta["routers"]:
        lines.append(f"Not judged: `{own}` is not among this grid's routers.")
    elif not [c for c in cells if not c.get("failed")]:
        lines.append("Not judged: no cell has results.")
    else:
        lines.append(f"None: `{own}` is best or within the winner's spread in every cell.")
    failed = [c for c in cells if c.get("failed")]
    if failed:
        lines += ["", "### Cells that failed", ""]
        for c in failed:
            lines.append(f"- {c['name']}: " + "; ".join(c["failed"]))
    lines += ["", "### Every cell", ""]
    for ci, c in enumerate(cells):
        if c.get("failed"):
            lines += [f"#### {c['name']}", "", "Failed: " + "; ".join(c["failed"]), ""]
            continue
        extra = []
        if c.get("slow_workers"):
            extra.append(
                "slow workers " + ", ".join(f"{w}: x{f:g}" for w, f in c["slow_workers"].items())
            )
        if c.get("join_at_s"):
            extra.append(
                "joining " + ", ".join(f"{w} at {t:g} s" for w, t in c["join_at_s"].items())
            )
        if c.get("max_num_seqs"):
            extra.append(
                "sequence slots " + ", ".join(f"{w}: {n}" for w, n in c["max_num_seqs"].items())
            )
        kv = f"; KV capacity {c['capacity_blocks']:,} blocks per engine"
        if cell_cpu_s is not None:
            kv += f"; {cell_cpu_s[ci]:,.1f} CPU s for its runs"
        if c["kv_exceeds_gpu"]:
            kv += " (**more than the GPU holds**)"
        if c.get("retain") is not None:
            extra.append("session retention")
        if c.get("slo") is not None:
            slo = c["slo"]
            bounds = ", ".join(
                f"{b.upper()} {slo[f'{b}_s']:g} s" for b in ("ttft", "tbt") if slo[f"{b}_s"]
            )
            extra.append(f"SLO {bounds}" + ("" if slo["admission"] else ", no admission"))
        cols = [k for k, _ in _POLICY_COLUMNS if any(k in r for r in c["routers"].values())]
        lines += [
            f"#### {c['name']}",
            "",
            f"{c['workload']} on {c['setup']}, {c['engines']} engines, arrival times "
            f"x{c['time_scale']:g}{kv}" + (f"; {'; '.join(extra)}" if extra else "") + ".",
            "",
            "| router | TTFT mean (s) | ± | TTFT p99 (s) | ± | block hit | busiest engine "
            "| rejected | KV-optimal | regret (tokens/req) |"
            + "".join(f" {dict(_POLICY_COLUMNS)[k]} |" for k in cols),
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(cols),
        ]
        for name, r in c["routers"].items():
            marks = "".join(f" ({m} winner)" for m in ("mean", "p99") if c[m].get("winner") == name)
            hit = "-" if r["block_hit_rate"] is None else f"{r['block_hit_rate'] * 100:.1f} %"
            lines.append(
                f"| {name}{marks} | {_s(r['ttft_mean_s'])} | {_s(r['ttft_mean_spread_s'])} | "
                f"{_s(r['ttft_p99_s'])} | {_s(r['ttft_p99_spread_s'])} | {hit} | "
                f"{r['max_worker_share'] * 100:.0f} % | {r['rejected']} | "
                f"{_share(r.get('kv_optimal_share'))} | "
                f"{_tokens(r.get('regret_tokens_per_request'))} |"
                + "".join(f" {_policy_value(k, r.get(k))} |" for k in cols)
            )
        lines += [
            "",
            f"`{own}`: mean TTFT {_loss(c['mean'])}; p99 TTFT {_loss(c['p99'])}.",
            "",
        ]
    return "\n".join(lines)


def heatmap(results: dict[str, Any], path: str | Path, *, title: str) -> None:
    """Per cell (rows) and router (columns), mean and p99 TTFT over the cell's best
    (1 = the winner), on a log colour scale; a router that rejected requests is grey."""
    import numpy as np
    from matplotlib.colors import LogNorm

    from quillcache.plotting import pyplot

    plt = pyplot()
    cells = results["cells"]
    routers = results["meta"]["routers"]
    height = max(3.0, 0.28 * len(cells) + 1.8)
    fig, axes = plt.subplots(
        1, 2, figsize=(2 * (1.2 + 0.55 * len(routers)) + 3.5, height), sharey=True
    )
    for ax, (metric, label) in zip(
        axes, (("ttft_mean_s", "mean TTFT"), ("ttft_p99_s", "p99 TTFT")), strict=True
    ):
        grid = np.full((len(cells), len(routers)), np.nan)
        for i, c in enumerate(cells):
            best = c["mean" if metric == "ttft_mean_s" else "p99"].get("best_s")
            for j, name in enumerate(routers):
                r = c["routers"].get(name)  # a failed cell has none
                if best and r is not None and r[metric] is not None and r["rejected"] == 0:
                    grid[i, j] = max(r[metric] / best, 1.0)
        finite = grid[np.isfinite(grid)]
        top = max(float(finite.max()) if finite.size else 2.0, 1.01)
        cmap = plt.get_cmap("viridis_r").copy()
        cmap.set_bad("lightgrey")
        im = ax.imshow(grid, aspect="auto", cmap=cmap, norm=LogNorm(vmin=1.0, vmax=top))
        ax.set_xticks(range(len(routers)), routers, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{label} / cell's best")
        if len(cells) * len(routers) <= 400:
            for i in range(len(cells)):
                for j in range(len(routers)):
                    if np.isfinite(grid[i, j]):
                        ax.text(
                            j,
                            i,
                            f"{grid[i, j]:.2g}",
                            ha="center",
                            va="center",
                            fontsize=6,
                            color="white" if grid[i, j] > top**0.5 else "black",
                        )
        fig.colorbar(im, ax=ax, fraction=0.04)
    axes[0].set_yticks(range(len(cells)), [c["name"] for c in cells], fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
