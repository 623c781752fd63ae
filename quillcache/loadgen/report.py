"""Summaries of a load run: percentiles, throughput, errors; as a table or JSON."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import numpy as np

from quillcache.loadgen.runner import Sample


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if len(values) else None  # ms


def summarize(samples: Sequence[Sample], wall_s: float) -> dict[str, Any]:
    ok = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in ok]
    e2e = [s.e2e_s for s in ok]
    itl = [x for s in ok for x in s.itl_s]
    errors = Counter(s.error.split(":")[0] for s in samples if not s.ok)
    prompt = sum(s.prompt_tokens for s in ok)
    cached = sum(s.cached_tokens for s in ok)
    out: dict[str, Any] = {
        "requests": len(samples),
        "ok": len(ok),
        "errors": sum(errors.values()),
        "error_kinds": dict(errors),
        # the first whole message of each kind: why, not only how many
        "error_examples": _examples(samples),
        "wall_s": wall_s,
        "req_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "output_tok_per_s": sum(s.output_tokens for s in ok) / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cache_hit_rate": cached / prompt if prompt else None,
        "workers": dict(Counter(s.worker for s in ok if s.worker)),
    }
    for name, values in (("ttft_ms", ttft), ("itl_ms", itl), ("e2e_ms", e2e)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}"] = _pct(values, q)
        out[f"{name}_mean"] = float(np.mean(values)) * 1000 if values else None
    return out


_ROWS = [
    ("requests", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("req/s", "req_per_s", "{:.1f}"),
    ("output tok/s", "output_tok_per_s", "{:.0f}"),
    ("TTFT p50 ms", "ttft_ms_p50", "{:.2f}"),
    ("TTFT p90 ms", "ttft_ms_p90", "{:.2f}"),
    ("TTFT p99 ms", "ttft_ms_p99", "{:.2f}"),
    ("ITL p50 ms", "itl_ms_p50", "{:.2f}"),
    ("ITL p99 ms", "itl_ms_p99", "{:.2f}"),
    ("E2E p50 ms", "e2e_ms_p50", "{:.2f}"),
    ("E2E p90 ms", "e2e_ms_p90", "{:.2f}"),
    ("E2E p99 ms", "e2e_ms_p99", "{:.2f}"),
    ("cache hit rate", "cache_hit_rate", "{:.1%}"),
]


def _examples(samples: Sequence[Sample]) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in samples:
        if not s.ok:
            out.setdefault(s.error.split(":")[0], s.error)
    return out


def render_table(results: dict[str, dict[str, Any]], title: str = "loadgen") -> Any:
    """A rich Table, one column per target, plus `+ vs <first>` for latency rows."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    names = list(results)
    for name in names:
        table.add_column(name, justify="right")
    if len(names) > 1:
        for name in names[1:]:
            table.add_column(f"{name} - {names[0]}", justify="right")
    for label, key, fmt in _ROWS:
        cells = []
        for name in names:
            v = results[name].get(key)
            cells.append("-" if v is None else fmt.format(v))
        if len(names) > 1:
            base = results[names[0]].get(key)
            for name in names[1:]:
                v = results[name].get(key)
                if key.endswith(("_p50", "_p90", "_p99")) and v is not None and base is not None:
                    cells.append(f"{v - base:+.2f}")
                else:
                    cells.append("")
        table.add_row(label, *cells)
    for name in names:  # why requests failed, one line per kind
        for kind, example in results[name].get("error_examples", {}).items():
            n = results[name]["error_kinds"].get(kind, 0)
            cells = [example[:120] if other == name else "" for other in names]
            table.add_row(f"error ({n}x)", *cells, *([""] * (len(names) - 1)))
    return table
