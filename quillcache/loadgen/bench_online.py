"""The online-mode numbers of docs/online.md, side by side in one run:

    python -m quillcache.loadgen.bench_online [--json out.json]

1. overhead: one engine simulator called directly vs through the gateway (the same
   engine behind it), 64 concurrent streams, alternated: the added TTFT / end-to-end
   latency;
2. throughput: routed non-streaming requests/s through the gateway (2 engines with
   `--time-scale 0`), alternated with one engine called directly, and each process's
   CPU per request;
3. ingest while serving: the gateway's routing latency (parse + tokenize + hash +
   route, measured inside the gateway) without and with a third engine flooding it
   with KV events, alternated, and the blocks/s it applied meanwhile.

Each phase alternates its two sides `--repeats` times in one run, so that the load of
a shared machine falls on both.

Every process is real (engine-sim, gateway) and on 127.0.0.1; the load generator is
this process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from quillcache.gateway.serve import run_loop
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
    run_loop(run_load(cfg, reqs[:warmup]))
    samples, wall = run_loop(run_load(cfg, reqs[warmup:]))
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
    workdir: Path, n: int, router: str, engine: str = "fixed:100,25", repeats: int = 3
) -> dict[str, Any]:
    """One engine simulator, called directly and through the gateway (the same engine
    behind it), alternated `repeats` times with the same 64-stream workload; the engine's
    prefix cache is reset before every run so that each starts cold. Returns each pair
    and the median of the added latencies.

    `engine` "fixed:TTFT,ITL" (ms): every request takes exactly that upstream, so the
    gateway is the only difference between the two sides; "model:SCALE": the engine
    model at that time scale, where 64 streams queue and batch differently from run to
    run (tens of ms of noise, more than the effect measured)."""
    kind, _, value = engine.partition(":")
    if kind == "fixed":
        args = engine_args(extra=["--fixed-latency-ms", value or "100,25"])
    elif kind == "model":
        args = engine_args(time_scale=float(value or 1.0))
    else:
        raise ValueError(f"--overhead-engine: 'fixed:TTFT,ITL' or 'model:SCALE', not {engine!r}")
    procs: list[Proc] = []
    try:
        upstream = launch("ov-engine", args, workdir)
        procs.append(upstream)
        gw = _gateway([upstream], workdir, "ov-gateway", router)
        procs.append(gw)
        reqs = synthetic(n, prefixes=16, prefix_chars=512, suffix_chars=64, max_tokens=16)
        admin = {"authorization": f"Bearer {ADMIN}"}

        def one(url: str) -> dict[str, Any]:
            httpx.post(upstream.url + "/reset_prefix_cache").raise_for_status()
            samples, wall = run_loop(run_load(RunConfig(url=url, concurrency=64), reqs))
            return summarize(samples, wall)

        pairs = []
        httpx.get(gw.url + "/admin/index?reset_latency=1", headers=admin)
        for _ in range(repeats):
            pairs.append({"direct": one(upstream.url), "gateway": one(gw.url)})
        info = httpx.get(gw.url + "/admin/index", headers=admin).json()
        added = {
            k: sorted(p["gateway"][k] - p["direct"][k] for p in pairs) for k in OVERHEAD_METRICS
        }
        return {
            "pairs": pairs,
            "added_median": {k: v[len(v) // 2] for k, v in added.items()},
            "engine": engine,
            "pre_upstream_us": info["pre_upstream_us"],
            "relay_chunk_us": info["relay_chunk_us"],
            "load_average": os.getloadavg(),
        }
    finally:
        for p in procs:
            p.kill()


OVERHEAD_METRICS = ("ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "req_per_s")


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


def ingest_while_serving(
    workdir: Path, n: int, router: str, blocks_per_s: float, repeats: int = 3
) -> dict[str, Any]:
    """Routing latency inside the gateway without and with an event flood, alternated
    `repeats` times in one run (quiet, flood, quiet, flood, ...), so that machine noise
    falls on both sides; the added p99 of each pair and their median."""
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
            try:
                result = _load(gw.url, n, concurrency=16, stream=False, max_tokens=4, warmup=20)
            finally:
                if flood:
                    httpx.delete(flooder.url + "/debug/flood").raise_for_status()
            wall = time.perf_counter() - t0
            stored = _metric(gw.url, "quillcache_kv_blocks_stored_total") - stored0
            info = httpx.get(gw.url + "/admin/index", headers=admin).json()
            result["route_latency_us"] = info["route_latency_us"]
            result["blocks_applied_per_s"] = stored / wall
            result["ingest"] = info["ingest"]
            time.sleep(1.0)  # let the ingest queue drain before the next phase
            return result

        pairs = [{"no flood": phase(False), "flood": phase(True)} for _ in range(repeats)]
        added = sorted(
            p["flood"]["route_latency_us"]["p99"] - p["no flood"]["route_latency_us"]["p99"]
            for p in pairs
        )
        return {
            "pairs": pairs,
            "added_p99_us": added,
            "median_added_p99_us": added[len(added) // 2],
            "load_average": os.getloadavg(),
        }
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
            samples, wall = run_loop(run_load(cfg, reqs))
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
        "--overhead-engine",
        default="fixed:100,25",
        help="'fixed:TTFT,ITL' (ms, a steady upstream) or 'model:SCALE' (the engine model)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternations of the throughput and ingest phases"
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    out: dict[str, Any] = {"router": args.router, "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="qc-bench-") as tmp:
        wd = Path(tmp)
        if args.only in (None, "overhead"):
            out["overhead"] = overhead(
                wd, args.requests, args.router, args.overhead_engine, args.repeats
            )
        if args.only in (None, "throughput"):
            out["throughput"] = throughput(wd, args.requests, args.router, args.repeats)
        if args.only in (None, "ingest"):
            out["ingest"] = ingest_while_serving(
                wd, args.requests // 2, args.router, args.flood_blocks_per_s, args.repeats
            )
        if args.only in (None, "routers"):
            out["routers"] = routers(wd, min(args.requests, 800), args.compare.split(","))
    console = Console()
    if "overhead" in out:
        ov = out["overhead"]
        t = Table(
            title="1. gateway overhead: one engine, 64 streams, direct vs through the gateway, "
            f"alternated (engine {ov['engine']})"
        )
        for c in (
            "metric",
            *(f"{i + 1}: direct / gateway / added" for i in range(len(ov["pairs"]))),
            "median added",
        ):
            t.add_column(c, justify="right")
        for k in OVERHEAD_METRICS:
            cells = [
                f"{p['direct'][k]:.2f} / {p['gateway'][k]:.2f} / "
                f"{p['gateway'][k] - p['direct'][k]:+.2f}"
                for p in ov["pairs"]
            ]
            t.add_row(k, *cells, f"{ov['added_median'][k]:+.2f}")
        t.add_row(
            "errors",
            *(f"{p['direct']['errors']} / {p['gateway']['errors']}" for p in ov["pairs"]),
            "",
        )
        console.print(t)
        pre, relay = ov["pre_upstream_us"], ov["relay_chunk_us"]
        console.print(
            "   inside the gateway, upstream chunk in -> written to the client: "
            f"p50 {relay['p50']:.0f} us, p90 {relay['p90']:.0f} us, p99 {relay['p99']:.0f} us"
        )
        console.print(
            "   inside the gateway, request in -> upstream request out (parse, tokenize, hash,"
            f" route): p50 {pre['p50']:.0f} us, p90 {pre['p90']:.0f} us, p99 {pre['p99']:.0f} us;"
            " load average %.2f %.2f %.2f" % tuple(ov["load_average"])
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
        ing = out["ingest"]
        t = Table(title="3. routing latency in the gateway while ingesting KV events, alternated")
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
        for i, pair in enumerate(ing["pairs"]):
            for name, r in pair.items():
                lat = r["route_latency_us"]
                t.add_row(
                    f"{i + 1}: {name}",
                    f"{r['blocks_applied_per_s']:.0f}",
                    f"{lat.get('p50', 0):.0f}",
                    f"{lat.get('p99', 0):.0f}",
                    f"{r['req_per_s']:.0f}",
                    str(r["ingest"]["dropped"]),
                    str(r["errors"]),
                )
        console.print(t)
        console.print(
            "   route p99 added by the flood, per pair: "
            + ", ".join(f"{a:+.0f} us" for a in ing["added_p99_us"])
            + f"; median {ing['median_added_p99_us']:+.0f} us; "
            "load average %.2f %.2f %.2f" % tuple(ing["load_average"])
        )
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
