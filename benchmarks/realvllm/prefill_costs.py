"""Prefill time against prompt length, cold and behind a cached prefix, on the real vLLM
CPU server the suite runs (the tiny Llama of `tiny_model.py`), fitted and compared with
the cost model's structure (docs/simulator.md, "The cost model against a real vLLM").

    QUILLCACHE_VLLM_PYTHON=~/.cache/quillcache/vllm-venv/bin/python \\
        python -m benchmarks.realvllm.prefill_costs --json /tmp/prefill.json

Each request sends token ids (no tokenizer in the timing) with `max_tokens=1`, one at a
time, so its latency is the engine's TTFT plus the HTTP round trip. A cold prompt starts
with a token no other prompt starts with (no shared block); a warm one first sends its
prefix alone, then the prefix plus a new suffix, and the server's own
`prompt_tokens_details.cached_tokens` says how much was reused.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.realvllm.launcher import (
    BLOCK,
    MAX_MODEL_LEN,
    SERVED_MODEL,
    VllmEngine,
    make_tiny_model,
    start_engines,
    vllm_python,
)
from benchmarks.realvllm.tiny_model import VOCAB

COLD_LENGTHS = (64, 128, 256, 384, 512, 640, 768, 896, 992)
TOTAL = 992  # warm runs: prefix + suffix = TOTAL tokens (max model length 1024)
PREFIXES = (256, 512, 768, 928)  # multiples of the block size: whole blocks cached
FIRST_TOKEN = 3  # ids below this are the tokenizer's special tokens


class Prompts:
    """Token-id prompts that share nothing unless asked to: each starts with an id no
    other prompt starts with."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.heads = iter(range(FIRST_TOKEN, VOCAB))

    def fresh(self, n: int) -> list[int]:
        return [next(self.heads)] + [self.rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n - 1)]


def _complete(client: httpx.Client, url: str, ids: list[int]) -> tuple[float, int]:
    """(seconds, cached prompt tokens) of one completion of one token."""
    body = {"model": SERVED_MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json()["usage"]
    if usage["prompt_tokens"] != len(ids):
        raise RuntimeError(f"sent {len(ids)} tokens, the server counted {usage['prompt_tokens']}")
    details = usage.get("prompt_tokens_details") or {}
    return dt, int(details.get("cached_tokens") or 0)


def measure(url: str, reps: int, seed: int) -> list[dict[str, Any]]:
    """Every (prefix, new tokens) point `reps` times, interleaved so that drift in the
    machine's load spreads over all points."""
    prompts = Prompts(seed)
    rows: list[dict[str, Any]] = []
    with httpx.Client(timeout=60) as client:
        for _ in range(8):  # warm-up: first calls pay lazy initialisation
            _complete(client, url, prompts.fresh(256))
        for rep in range(reps):
            for n in COLD_LENGTHS:
                dt, cached = _complete(client, url, prompts.fresh(n))
                rows.append({"rep": rep, "prefix": 0, "new": n, "cached": cached, "s": dt})
            for p in PREFIXES:
                prefix = prompts.fresh(p)
                _complete(client, url, prefix)
                suffix = [prompts.rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(TOTAL - p)]
                dt, cached = _complete(client, url, prefix + suffix)
                rows.append({"rep": rep, "prefix": p, "new": TOTAL - p, "cached": cached, "s": dt})
    return rows


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["prefix"], r["new"]), []).append(r)
    out = []
    for (prefix, new), rs in sorted(by.items()):
        out.append(
            {
                "prefix": prefix,
                "new": new,
                "cached_tokens": statistics.median(r["cached"] for r in rs),
                "ttft_ms": round(1e3 * statistics.median(r["s"] for r in rs), 3),
                "ttft_ms_min": round(1e3 * min(r["s"] for r in rs), 3),
                "n": len(rs),
            }
        )
    return out


def _design(
    points: list[dict[str, Any]], key: str, *, per_prompt_token: bool
) -> tuple[np.ndarray, np.ndarray]:
    """The cost model's prefill form, TTFT = a + b * new + c * pairs, as a design matrix:
    pairs = new * (context + (new + 1) / 2), one per query-key pair, context = the
    tokens actually reused (`CostModel.prefill_compute_s`). With `per_prompt_token`, a
    fourth term d * prompt tokens: work a cache hit does not save."""
    new = np.array([p["new"] for p in points], dtype=float)
    ctx = np.array([p["cached_tokens"] for p in points], dtype=float)
    cols = [np.ones_like(new), new, new * (ctx + (new + 1) / 2)]
    if per_prompt_token:
        cols.append(new + ctx)
    y = np.array([p[key] for p in points], dtype=float)
    return np.stack(cols, axis=1), y


def fit(
    points: list[dict[str, Any]],
    train: list[dict[str, Any]],
    key: str,
    *,
    per_prompt_token: bool = False,
) -> dict[str, Any]:
    """Least squares on `train`, evaluated on every point (`key`: the statistic)."""
    x_train, y_train = _design(train, key, per_prompt_token=per_prompt_token)
    coef, *_ = np.linalg.lstsq(x_train, y_train, rcond=None)
    x, y = _design(points, key, per_prompt_token=per_prompt_token)
    pred = x @ coef
    out = {
        "fixed_ms": round(float(coef[0]), 3),
        "per_new_token_us": round(1e3 * float(coef[1]), 3),
        "per_pair_ns": round(1e6 * float(coef[2]), 3),
        "error_pct": [round(float(e), 1) for e in (pred - y) / y * 100],
    }
    if per_prompt_token:
        out["per_prompt_token_us"] = round(1e3 * float(coef[3]), 3)
    return out


def fits(points: list[dict[str, Any]]) -> dict[str, Any]:
    """Per statistic (the median, and the minimum: the least disturbed run on a shared
    machine): the cost model's form fitted to every point, fitted to the cold points
    alone (so the cached-prefix points are predictions), and with a per-prompt-token
    term."""
    cold = [p for p in points if p["prefix"] == 0]
    return {
        key: {
            "cost_model_form": fit(points, points, key),
            "cold_only": fit(points, cold, key),
            "with_per_prompt_token": fit(points, points, key, per_prompt_token=True),
        }
        for key in ("ttft_ms", "ttft_ms_min")
    }


def cost_model_ratios() -> dict[str, Any]:
    """The same points on the default cost model (Llama-3.1-8B, A100): its TTFT, alone
    on an idle worker, for each measured (prefix, new) point."""
    from quillcache.costmodel import CostModel

    cost = CostModel()
    out: dict[str, Any] = {}
    for n in COLD_LENGTHS:
        out[f"cold {n}"] = 1e3 * cost.estimate_ttft(prompt_tokens=n, cached_tokens=0).ttft_s
    for p in PREFIXES:
        est = cost.estimate_ttft(prompt_tokens=TOTAL, cached_tokens=p)
        out[f"{p} cached + {TOTAL - p}"] = 1e3 * est.ttft_s
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=25, help="repetitions of every point (25)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE", help="write raw rows, medians and fits")
    args = ap.parse_args(argv)
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="qc-prefill-") as tmp:
        work = Path(tmp)
        model = make_tiny_model(python, work / "model")
        engine = VllmEngine("prefill")
        start_engines(python, model, work, [engine])
        try:
            version = httpx.get(engine.url + "/version", timeout=5).json().get("version")
            t0 = time.perf_counter()
            rows = measure(engine.url, args.reps, args.seed)
            wall = time.perf_counter() - t0
        finally:
            engine.kill()
    points = medians(rows)
    result = {
        "vllm": version,
        "block_size": BLOCK,
        "max_model_len": MAX_MODEL_LEN,
        "reps": args.reps,
        "wall_s": round(wall, 1),
        "points": points,
        "fits": fits(points),
        "cost_model_ms": {k: round(v, 3) for k, v in cost_model_ratios().items()},
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    json.dump({k: v for k, v in result.items() if k != "rows"}, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
