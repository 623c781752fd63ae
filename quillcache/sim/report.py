"""Comparison table (rich) and plots (matplotlib, Agg) of simulation results."""

from __future__ import annotations

from typing import Any


def _f(x: Any, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def table(results: list[dict[str, Any]], meta: dict[str, Any], *, sweep_workers: bool) -> None:
    from rich.table import Table

    from quillcache.console import table_console

    full = meta["timing"] == "full"
    sweep_cap = any("capacity_point" in r for r in results)
    replicas = any("replicas" in r for r in results)
    replicate = any("replications" in r for r in results)
    slo = any("slo_met_share" in r for r in results)
    retain = any("retention_touches" in r for r in results)
    followups = any("followup_reuse_share" in r for r in results)
    t = Table(
        title=f"{meta['workload']}: {meta['requests']} requests, "
        f"block size {meta['block_size']}, timing {meta['timing']}",
        title_justify="left",
        caption="KV GiB: the KV memory per engine its capacity implies; "
        "! = more than the cost model's GPU holds beside the weights"
        if any(r["kv_exceeds_gpu"] for r in results)
        else None,
        caption_justify="left",
    )
    cols = ["router", "backend"]
    if sweep_workers:
        cols.append("workers")
    if sweep_cap:
        cols.append("capacity")
    if replicas:
        cols += ["replicas", "state", "precision"]
    cols += ["KV GiB", "block hit", "token hit", "prefill tok", "KV-opt", "regret/req"]
    if replicate:
        cols += ["copies", "copy tok", "copy tok %"]
    if followups:
        cols.append("follow-up reuse")
    if retain:
        cols += ["touches", "touch tok %"]
    if full:
        cols += ["TTFT mean", "p50", "p99", "E2E mean", "req/s"]
    if slo:
        cols += ["SLO met", "goodput"]
    cols += ["rejected", "share CV", "match µs", "wall s"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("router", "backend") else "right")
    for r in results:
        row = [r["router"], r["backend"]]
        if sweep_workers:
            row.append(str(r["workers"]))
        if sweep_cap:
            row.append(str(r.get("capacity_point", r["capacity_blocks"])))
        if replicas:
            row += [
                str(r.get("replicas", "")),
                r.get("replica_state", ""),
                _f(r.get("routing_precision"), ".3f"),
            ]
        row += [
            _kv_gib(r),
            _f(r["block_hit_rate"] * 100, ".1f") + "%",
            _f(r["token_hit_rate"] * 100, ".1f") + "%",
            f"{r['prefill_tokens_computed']:,}",
            _f(_pct(r.get("kv_optimal_share")), ".1f") + "%",
            _f(r.get("regret_tokens_per_request"), ",.1f"),
        ]
        if replicate:
            row += [
                str(r.get("replications", "")),
                f"{r.get('replication_prefill_tokens', 0):,}",
                _f(r.get("replication_prefill_pct"), ".2f") + "%",
            ]
        if followups:
            row.append(_f(_pct(r.get("followup_reuse_share")), ".1f") + "%")
        if retain:
            row += [
                str(r.get("retention_touches", 0) + r.get("retention_prefetches", 0)),
                _f(r.get("retention_prefill_pct"), ".2f") + "%",
            ]
        if full:
            row += [
                _f(r["ttft_mean_s"], ".3f"),
                _f(r["ttft_p50_s"], ".3f"),
                _f(r["ttft_p99_s"], ".3f"),
                _f(r["e2e_mean_s"], ".2f"),
                _f(r["throughput_rps"], ".2f"),
            ]
        if slo:
            row += [
                _f(_pct(r.get("slo_met_share")), ".1f") + "%",
                _f(_pct(r.get("slo_goodput_share")), ".1f") + "%",
            ]
        row += [
            str(r["rejected"]),
            _f(r["worker_share_cv"], ".3f"),
            _f(r.get("match_us_mean"), ".1f"),
            _f(r.get("wall_s"), ".2f"),
        ]
        t.add_row(*row)
    table_console().print(t)


def _pct(share: float | None) -> float | None:
    return None if share is None else share * 100


def _kv_gib(r: dict[str, Any]) -> str:
    """KV memory per engine its capacity implies; `!` past what the GPU holds."""
    if r.get("capacity_point") == "unbounded":
        return "-"
    return _f(r["kv_gib_per_engine"], ",.1f") + ("!" if r["kv_exceeds_gpu"] else "")


def _label(r: dict[str, Any], results: list[dict[str, Any]]) -> str:
    """Only what varies across `results`: the router, then backend / workers if they do."""
    parts = [r["router"]]
    if len({x["backend"] for x in results}) > 1:
        parts.append(r["backend"])
    if len({x["workers"] for x in results}) > 1:
        parts.append(f"{r['workers']} workers")
    if len({x.get("replicas") for x in results}) > 1:
        parts.append(f"{r['replicas']} replicas")
    if len({x.get("replica_state") for x in results}) > 1:
        parts.append(str(r["replica_state"]))
    return " / ".join(parts)


_STYLES = [("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", "-"), ("P", "--")]


def plot(results: list[dict[str, Any]], path: str, *, title: str = "") -> None:
    """Hit rate and TTFT per router (horizontal bars: long names stay legible); with a
    capacity sweep, hit rate vs capacity instead, one line per router."""
    from quillcache.plotting import pyplot

    plt = pyplot()
    sweep = [r for r in results if "capacity_point" in r]
    if sweep:
        _plot_sweep(plt, sweep, path, title)
        return
    has_ttft = any(r.get("ttft_mean_s") is not None for r in results)
    panels = 1 + int(has_ttft)
    labels = [_label(r, results) for r in results]
    height = max(3.0, 0.35 * len(results) + 1.2)
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, height), squeeze=False)
    rows = range(len(results))
    ax = axes[0][0]
    ax.barh(rows, [r["block_hit_rate"] * 100 for r in results])
    ax.set_yticks(list(rows), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("block hit rate (%)")
    ax.set_title("hit rate per router")
    if has_ttft:
        ax = axes[0][1]
        ax.barh(rows, [r.get("ttft_mean_s") or 0.0 for r in results], color="tab:orange")
        ax.set_yticks(list(rows), labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("mean TTFT (s)")
        ax.set_title("TTFT per router")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _coincide(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    """Two lines a reader cannot tell apart: the same points within a quarter point."""
    return [x for x, _ in a] == [x for x, _ in b] and all(
        abs(ya - yb) < 0.25 for (_, ya), (_, yb) in zip(a, b, strict=True)
    )


def _plot_sweep(plt: Any, sweep: list[dict[str, Any]], path: str, title: str) -> None:
    """Capacities on a log axis, each one labelled; "unbounded" gets its own tick past
    the largest. Lines that coincide stay visible: each router has its own marker and
    dash, drawn with some transparency, and the legend says which ones coincide."""
    finite = sorted({r["capacity_point"] for r in sweep if r["capacity_point"] != "unbounded"})
    unbounded_x = (finite[-1] * 4) if finite else 1
    fig, ax = plt.subplots(figsize=(8, 5))
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in sweep:
        cap = r["capacity_point"]
        x = unbounded_x if cap == "unbounded" else cap
        lines.setdefault(_label(r, sweep), []).append((x, r["block_hit_rate"] * 100))
    for pts in lines.values():
        pts.sort()
    for i, (name, pts) in enumerate(lines.items()):
        marker, dash = _STYLES[i % len(_STYLES)]
        twins = [other for other, o in lines.items() if other != name and _coincide(pts, o)]
        label = f"{name} (≈ {', '.join(twins)})" if twins else name
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            marker=marker,
            linestyle=dash,
            alpha=0.8,
            markersize=7 - (i % 3),
            label=label,
        )
    ticks = (
        [*finite, unbounded_x] if any(r["capacity_point"] == "unbounded" for r in sweep) else finite
    )
    ax.set_xscale("log")
    ax.set_xticks(ticks, [f"{t:,}" for t in finite] + ["unbounded"] * (len(ticks) - len(finite)))
    ax.minorticks_off()
    ax.set_xlabel("KV capacity per worker (blocks)")
    ax.set_ylabel("block hit rate (%)")
    ax.set_title(title or "hit rate vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
