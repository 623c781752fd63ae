"""The online-mode numbers of docs/online.md, side by side in one run:

    python -m quillcache.loadgen.bench_online [--json out.json]

1. overhead: one engine simulator called directly vs through the gateway (the same
   engine behind it), 64 concurrent streams: the added TTFT / end-to-end latency;
2. throughput: routed non-streaming requests/s through the gateway (2 engines with
   `--time-scale 0`), next to one engine called directly;
3. ingest while serving: the gateway's routing latency (parse + tokenize + hash +
   route, measured inside the gateway) with and without a third engine flooding it
   with KV events, and the blocks/s it applied meanwhile.

Every process is real (engine-sim, gateway) and on 127.0.0.1; the load generator is
this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from quillcache.loadgen.report import summarize
from quillcache.loadgen.runner import RunConfig, run_load
from quillcache.loadgen.workload import synthetic
from quillcache.up import Proc, engine_args, gateway_args, launch

ADMIN = "bench"


def _load(
    url: str,
    n: int,
    *,
    concurrency: int,
    stream: bool,
    max_tokens: int,
    warmup: int = 100,
    seed: int = 0,
) -> dict[str, Any]:
    reqs = synthetic(
        n + warmup, prefixes=16, prefix_chars=512, suffix_chars=64, max_tokens=max_tokens, seed=seed
    )
    cfg = RunConfig(url=url, concurrency=concurrency, stream=stream)
    asyncio.run(run_load(cfg, reqs[:warmup]))
    samples, wall = asyncio.run(run_load(cfg, reqs[warmup:]))
    return summarize(samples, wall)


def _gateway(engines: list[Proc], workdir: Path, name: str, router: str) -> Proc:
    cfg = workdir / f"{name}.json"
    cfg.write_text(
        json.dumps(
            {"tokenizer": "builtin", "admin_token": ADMIN, "router": router, "log_level": "error"}
        )
    )
    return launch(
        name, gateway_args([e.url for e in engines], extra=["--config", str(cfg)]), workdir
    )


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def overhead(
    workdir: Path, n: int, router: str, time_scale: float = 1.0, together: bool = False
) -> dict[str, Any]:
    """Two identical fresh engines, one called directly, one through the gateway, with the
    same workload (64 streams): one after the other (default), or both at once
    (`together`: machine noise hits both sides alike, but the load doubles)."""
    procs: list[Proc] = []
    try:
        engines = [
            launch(f"ov-engine{i}", engine_args(time_scale=time_scale), workdir) for i in range(2)
        ]
        procs += engines
        gw = _gateway([engines[1]], workdir, "ov-gateway", router)
        procs.append(gw)
        reqs = synthetic(n, prefixes=16, prefix_chars=512, suffix_chars=64, max_tokens=16)
        direct_cfg = RunConfig(url=engines[0].url, concurrency=64)
        gateway_cfg = RunConfig(url=gw.url, concurrency=64)

        async def both() -> list[tuple[list[Any], float]]:
            return await asyncio.gather(run_load(direct_cfg, reqs), run_load(gateway_cfg, reqs))

        if together:
            (d, dw), (g, gw_wall) = asyncio.run(both())
        else:
            d, dw = asyncio.run(run_load(direct_cfg, reqs))
            g, gw_wall = asyncio.run(run_load(gateway_cfg, reqs))
        info = httpx.get(gw.url + "/admin/index", headers={"authorization": f"Bearer {ADMIN}"})
        return {
            "direct": summarize(d, dw),
            "gateway": summarize(g, gw_wall),
            "time_scale": time_scale,
            "together": together,
            "pre_upstream_us": info.json()["pre_upstream_us"],
            "relay_chunk_us": info.json()["relay_chunk_us"],
        }
    finally:
        for p in procs:
            p.kill()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (Linux /proc), for CPU cost per request."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_ms_per_request(
    pids: dict[str, int], n: int, run: Any
) -> tuple[dict[str, Any], dict[str, float]]:
    """Run `run()` and return its result with each process's CPU ms per request: who
    spends the two cores (the load generator is this process)."""
    before = {name: _cpu_s(pid) for name, pid in pids.items()}
    result = run()
    return result, {name: (_cpu_s(pid) - before[name]) * 1000 / n for name, pid in pids.items()}


def throughput(workdir: Path, n: int, router: str, repeats: int = 2) -> dict[str, Any]:
    """Direct (one engine) and through the gateway (two engines), alternated `repeats`
    times in one run, with every process's CPU per request."""
    procs: list[Proc] = []
    try:
        engines = [launch(f"tp-engine{i}", engine_args(time_scale=0.0), workdir) for i in range(2)]
        procs += engines
        gw = _gateway(engines, workdir, "tp-gateway", router)
        procs.append(gw)
        pids = {"loadgen": os.getpid(), "gateway": gw.popen.pid}
        pids.update({f"engine{i}": e.popen.pid for i, e in enumerate(engines)})
        _load(gw.url, 200, concurrency=64, stream=False, max_tokens=1, warmup=0)  # warm up
        out: dict[str, list[dict[str, Any]]] = {"direct (1 engine)": [], "gateway (2 engines)": []}
        for _ in range(repeats):
            for name, url in (
                ("direct (1 engine)", engines[0].url),
                ("gateway (2 engines)", gw.url),
            ):
                result, cpu = _cpu_ms_per_request(
                    pids,
                    n,
                    lambda u=url: _load(u, n, concurrency=64, stream=False, max_tokens=1, warmup=0),
                )
                result["cpu_ms_per_request"] = cpu
                out[name].append(result)
        return {"runs": out, "load_average": os.getloadavg()}
    finally:
        for p in procs:
            p.kill()


def ingest_while_serving(workdir: Path, n: int, router: str, blocks_per_s: float) -> dict[str, Any]:
    procs: list[Proc] = []
    admin = {"authorization": f"Bearer {ADMIN}"}
    try:
        engines = [launch(f"in-engine{i}", engine_args(), workdir) for i in range(2)]
        flooder = launch("in-flooder", engine_args(), workdir)
        procs += [*engines, flooder]
        gw = _gateway([*engines, flooder], workdir, "in-gateway", router)
        procs.append(gw)
        # the flooder only publishes events: no traffic for it
        httpx.post(gw.url + "/admin/workers/2/drain", headers=admin, json={"draining": True})

        def phase(flood: bool) -> dict[str, Any]:
            httpx.get(gw.url + "/admin/index?reset_latency=1", headers=admin)
            stored0 = _metric(gw.url, "quillcache_kv_blocks_stored_total")
            t0 = time.perf_counter()
            if flood:
                r = httpx.post(
                    flooder.url + "/debug/flood",
                    json={"blocks_per_s": blocks_per_s, "seconds": 600},
                )
                r.raise_for_status()
            result = _load(gw.url, n, concurrency=16, stream=False, max_tokens=4, warmup=20)
            wall = time.perf_counter() - t0
            stored = _metric(gw.url, "quillcache_kv_blocks_stored_total") - stored0
            info = httpx.get(gw.url + "/admin/index", headers=admin).json()
            result["route_latency_us"] = info["route_latency_us"]
            result["blocks_applied_per_s"] = stored / wall
            result["ingest"] = info["ingest"]
            return result

        quiet = phase(False)
        flooded = phase(True)
        return {"no flood": quiet, "flood": flooded}
    finally:
        for p in procs:
            p.kill()


def routers(workdir: Path, n: int, names: list[str]) -> dict[str, Any]:
    """The same workload through the gateway with each router: 4 engines with small
    caches (512 blocks), 32 shared prefixes of ~1,000 tokens, streaming."""
    out: dict[str, Any] = {}
    for name in names:
        procs: list[Proc] = []
        try:
            extra = ["--num-gpu-blocks", "512"]
            engines = [
                launch(f"rt-{name}-engine{i}", engine_args(extra=extra), workdir) for i in range(4)
            ]
            procs += engines
            gw = _gateway(engines, workdir, f"rt-{name}-gateway", name)
            procs.append(gw)
            reqs = synthetic(
                n, prefixes=32, prefix_chars=1000, suffix_chars=48, max_tokens=8, seed=7
            )
            cfg = RunConfig(url=gw.url, concurrency=32, stream=True)
            samples, wall = asyncio.run(run_load(cfg, reqs))
            out[name] = summarize(samples, wall)
        finally:
            for p in procs:
                p.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--router", default="quillcache")
    parser.add_argument("--flood-blocks-per-s", type=float, default=150_000)
    parser.add_argument(
        "--only", choices=["overhead", "throughput", "ingest", "routers"], default=None
    )
    parser.add_argument(
        "--compare",
        default="round-robin,quillcache",
        help="routers for the comparison phase, comma-separated",
    )
    parser.add_argument(
        "--overhead-together",
        action="store_true",
        help="load the direct engine and the gateway at the same time",
    )
    parser.add_argument("--overhead-time-scale", type=float, default=1.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    out: dict[str, Any] = {"router": args.router, "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="qc-bench-") as tmp:
        wd = Path(tmp)
        if args.only in (None, "overhead"):
            out["overhead"] = overhead(
                wd, args.requests, args.router, args.overhead_time_scale, args.overhead_together
            )
        if args.only in (None, "throughput"):
            out["throughput"] = throughput(wd, args.requests, args.router)
        if args.only in (None, "ingest"):
            out["ingest"] = ingest_while_serving(
                wd, args.requests // 2, args.router, args.flood_blocks_per_s
            )
        if args.only in (None, "routers"):
            out["routers"] = routers(wd, min(args.requests, 800), args.compare.split(","))
    console = Console()
    if "overhead" in out:
        d, g = out["overhead"]["direct"], out["overhead"]["gateway"]
        how = "at once" if out["overhead"]["together"] else "one after the other"
        t = Table(title=f"1. gateway overhead: 64 streams direct, 64 via the gateway, {how}")
        for c in ("metric", "direct", "gateway", "added"):
            t.add_column(c, justify="right")
        for k in ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "req_per_s"):
            t.add_row(k, f"{d[k]:.2f}", f"{g[k]:.2f}", f"{g[k] - d[k]:+.2f}")
        t.add_row("errors", str(d["errors"]), str(g["errors"]), "")
        console.print(t)
        pre = out["overhead"]["pre_upstream_us"]
        relay = out["overhead"]["relay_chunk_us"]
        console.print(
            "   inside the gateway, upstream chunk in -> written to the client: "
            f"p50 {relay['p50']:.0f} us, p90 {relay['p90']:.0f} us, p99 {relay['p99']:.0f} us"
        )
        console.print(
            "   inside the gateway, request in -> upstream request out (parse, tokenize, hash,"
            f" route): p50 {pre['p50']:.0f} us, p90 {pre['p90']:.0f} us, p99 {pre['p99']:.0f} us"
        )
    if "throughput" in out:
        runs = out["throughput"]["runs"]
        names = list(next(iter(runs.values()))[0]["cpu_ms_per_request"])
        t = Table(title="2. non-streaming requests/s (max_tokens 1, concurrency 64), alternated")
        for c in ("target", "req/s", "e2e p50 ms", "e2e p99 ms", "errors"):
            t.add_column(c, justify="right")
        for c in names:
            t.add_column(f"{c} CPU ms/req", justify="right")
        for name, results in runs.items():
            for r in results:
                cpu = r["cpu_ms_per_request"]
                t.add_row(
                    name,
                    f"{r['req_per_s']:.0f}",
                    f"{r['e2e_ms_p50']:.2f}",
                    f"{r['e2e_ms_p99']:.2f}",
                    str(r["errors"]),
                    *(f"{cpu[c]:.3f}" for c in names),
                )
        console.print(t)
        gw_cpu = [r["cpu_ms_per_request"]["gateway"] for r in runs["gateway (2 engines)"]]
        console.print(
            f"   gateway CPU per routed request: {min(gw_cpu):.3f}-{max(gw_cpu):.3f} ms "
            f"(= {1000 / max(gw_cpu):.0f}-{1000 / min(gw_cpu):.0f} req/s per free core); "
            "load average %.2f %.2f %.2f" % tuple(out["throughput"]["load_average"])
        )
    if "ingest" in out:
        t = Table(title="3. routing latency in the gateway while ingesting KV events")
        for c in (
            "phase",
            "blocks applied/s",
            "route p50 us",
            "route p99 us",
            "req/s",
            "dropped",
            "errors",
        ):
            t.add_column(c, justify="right")
        for name, r in out["ingest"].items():
            lat = r["route_latency_us"]
            t.add_row(
                name,
                f"{r['blocks_applied_per_s']:.0f}",
                f"{lat.get('p50', 0):.0f}",
                f"{lat.get('p99', 0):.0f}",
                f"{r['req_per_s']:.0f}",
                str(r["ingest"]["dropped"]),
                str(r["errors"]),
            )
        console.print(t)
    if "routers" in out:
        t = Table(title="4. routers end to end: 4 engine simulators (512 blocks each), 32 prefixes")
        for c in (
            "router",
            "engine cache hit rate",
            "TTFT p50 ms",
            "TTFT p99 ms",
            "req/s",
            "errors",
        ):
            t.add_column(c, justify="right")
        for name, r in out["routers"].items():
            hit = r["cache_hit_rate"]
            t.add_row(
                name,
                "-" if hit is None else f"{hit:.1%}",
                f"{r['ttft_ms_p50']:.1f}",
                f"{r['ttft_ms_p99']:.1f}",
                f"{r['req_per_s']:.1f}",
                str(r["errors"]),
            )
        console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
