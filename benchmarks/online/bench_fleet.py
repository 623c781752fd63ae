"""The gateway in front of many engines (issue 15), side by side in one run:

    python -m benchmarks.online.bench_fleet [--small 4] [--large 256] [--idle 1024] \\
        [--requests 2000] [--repeats 2] [--idle-seconds 30] [--json out.json]

1. routed requests: one gateway in front of `--small` and then `--large` simulated
   engines (all served by one `engine-sim --engines N` process, so the simulators cost
   one process, not N), the same non-streaming load through each (`--requests` at
   `--concurrency`, after a warm-up), alternated `--repeats` times; the gateway's CPU
   seconds (utime + stime from /proc/<pid>/stat) over the load, per routed request.
   That figure includes what the gateway does meanwhile in the background (health
   checks and metric scrapes of every engine every second): it is the gateway's cost
   per request at that fleet size. The window opens once the start-up work on the
   event sources is over (each caught up, each first connection checked: once per
   start, O(fleet)). Target: large <= 1.2 x small.
2. idle: a gateway in front of `--idle` engines and no requests for `--idle-seconds`
   (after the fleet is up and healthy): its CPU as a fraction of one core. Target:
   <= 10 % at 1,024 engines.

Every stack (engine-sim process + gateway) starts fresh for its measurement and is
killed after it; each gateway's engines must all be healthy before and after (a
health check that failed would make the gateway do less). Run from the repo root.
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

from benchmarks.online.bench_online import _cpu_s, _load
from quillcache.up import Proc, launch

ADMIN = "bench"


def _engines(workdir: Path, n: int, name: str) -> Proc:
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    args = [
        "engine-sim",
        "--engines",
        str(n),
        "--port",
        "0",
        "--time-scale",
        "0",
        "--num-gpu-blocks",
        "1024",
        "--kv-events-config",
        json.dumps(kv),
    ]
    return launch(name, args, workdir, timeout_s=60 + n / 10)


BACKGROUND_INTERVAL_S = 1.0  # health checks and scrapes (the gateway's default)


def _gateway(workdir: Path, urls: list[str], name: str, router: str) -> Proc:
    cfg = workdir / f"{name}.json"
    settings: dict[str, Any] = {
        "tokenizer": "builtin",
        "admin_token": ADMIN,
        "router": router,
        "log_level": "error",
        # the start-up probe of every engine is not what is measured (and would still
        # be running at 1,024 engines)
        "parity_check": False,
        "workers": [{"url": u} for u in urls],
        "health_interval_s": BACKGROUND_INTERVAL_S,
        "scrape_interval_s": BACKGROUND_INTERVAL_S,
    }
    cfg.write_text(json.dumps(settings))
    return launch(
        name, ["gateway", "--port", "0", "--config", str(cfg)], workdir, 60 + len(urls) / 5
    )


def _healthy(gw: Proc, n: int, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the gateway lists `n` healthy workers, each subscribed to its events."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + timeout_s
    workers: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        workers = httpx.get(gw.url + "/admin/workers", headers=admin, timeout=30).json()["workers"]
        healthy = sum(1 for w in workers if w["healthy"])
        if len(workers) == n and healthy == n and all(w["kv_sources"] for w in workers):
            return {"workers": n, "healthy": healthy}
        time.sleep(0.5)
    raise RuntimeError(
        f"{gw.name}: {sum(1 for w in workers if w['healthy'])} of {n} workers healthy after "
        f"{timeout_s:.0f} s"
    )


def _metric(text: str, name: str) -> float:
    """One unlabelled sample of the gateway's /metrics page (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _settled(gw: Proc, n: int, timeout_s: float = 60.0) -> None:
    """Wait until the start-up work on the `n` event sources is over: every source caught
    up, and each one's check after its first connection done (the ingestor asks every
    replay socket once, a second after the connection: `quiet_tail_s`). That work comes
    once per start and is O(fleet); left in the window it would be charged to the
    routed requests."""
    deadline = time.monotonic() + timeout_s
    caught_up = checks = 0.0
    while time.monotonic() < deadline:
        text = httpx.get(gw.url + "/metrics", timeout=30).text
        caught_up = _metric(text, "quillcache_kv_sources_caught_up")
        checks = _metric(text, "quillcache_kv_event_tail_checks_total")
        if caught_up >= n and checks >= n:
            return
        time.sleep(0.5)
    raise RuntimeError(
        f"{gw.name}: {caught_up:.0f} of {n} event sources caught up and {checks:.0f} start-up "
        f"checks done after {timeout_s:.0f} s"
    )


def routed(workdir: Path, n: int, requests: int, concurrency: int, router: str) -> dict[str, Any]:
    """One fresh stack of `n` engines: the gateway's CPU per routed request."""
    procs: list[Proc] = []
    try:
        sim = _engines(workdir, n, f"sim{n}")
        procs.append(sim)
        urls = [e["url"] for e in sim.ready["engines"]] if n > 1 else [sim.url]
        gw = _gateway(workdir, urls, f"gw{n}", router)
        procs.append(gw)
        _healthy(gw, n)
        _settled(gw, n)
        _load(gw.url, 200, concurrency=concurrency, stream=False, max_tokens=4, warmup=0)
        admin = {"authorization": f"Bearer {ADMIN}"}
        httpx.get(gw.url + "/admin/index?reset_latency=1", headers=admin, timeout=30)
        pids = {"gateway": gw.popen.pid, "engines": sim.popen.pid, "loadgen": os.getpid()}
        before = {k: _cpu_s(p) for k, p in pids.items()}
        t0 = time.perf_counter()
        result = _load(
            gw.url, requests, concurrency=concurrency, stream=False, max_tokens=4, warmup=0, seed=1
        )
        wall = time.perf_counter() - t0
        cpu = {k: _cpu_s(p) - before[k] for k, p in pids.items()}
        after = _healthy(gw, n, timeout_s=5)
        info = httpx.get(gw.url + "/admin/index", headers=admin, timeout=30).json()
        return {
            "engines": n,
            # tokenize + hash + route inside the gateway (the part that grows with the
            # fleet is ControlPlane.route: the view and the router)
            "route_latency_us": info["route_latency_us"],
            "ok": result["ok"],
            "errors": result["errors"],
            "error_kinds": result["error_kinds"],
            "req_per_s": result["req_per_s"],
            "e2e_ms_p50": result["e2e_ms_p50"],
            "e2e_ms_p99": result["e2e_ms_p99"],
            "wall_s": wall,
            "gateway_cpu_ms_per_request": cpu["gateway"] * 1000 / max(result["ok"], 1),
            "cores_busy": {k: v / wall for k, v in cpu.items()},
            "workers_served": len(result["workers"]),
            "healthy_after": after["healthy"],
        }
    finally:
        for p in procs:
            p.kill()


def idle(workdir: Path, n: int, seconds: float, router: str) -> dict[str, Any]:
    """A fresh stack of `n` engines and no requests: the gateway's CPU share of a core."""
    procs: list[Proc] = []
    try:
        sim = _engines(workdir, n, f"idle-sim{n}")
        procs.append(sim)
        urls = [e["url"] for e in sim.ready["engines"]] if n > 1 else [sim.url]
        gw = _gateway(workdir, urls, f"idle-gw{n}", router)
        procs.append(gw)
        up = _healthy(gw, n, timeout_s=120)
        time.sleep(3.0)  # start-up work (first scrapes, subscriptions) out of the window
        before = {"gateway": _cpu_s(gw.popen.pid), "engines": _cpu_s(sim.popen.pid)}
        t0 = time.perf_counter()
        time.sleep(seconds)
        wall = time.perf_counter() - t0
        gw_cpu = _cpu_s(gw.popen.pid) - before["gateway"]
        sim_cpu = _cpu_s(sim.popen.pid) - before["engines"]
        after = _healthy(gw, n, timeout_s=5)
        return {
            "engines": n,
            "seconds": wall,
            "gateway_core_fraction": gw_cpu / wall,
            "engines_core_fraction": sim_cpu / wall,
            "healthy_before": up["healthy"],
            "healthy_after": after["healthy"],
            "gateway_threads": len(os.listdir(f"/proc/{gw.popen.pid}/task")),
            "gateway_fds": len(os.listdir(f"/proc/{gw.popen.pid}/fd")),
        }
    finally:
        for p in procs:
            p.kill()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=4, help="engines of the reference fleet")
    ap.add_argument("--large", type=int, default=256, help="engines of the large fleet")
    ap.add_argument("--idle", type=int, default=1024, help="engines of the idle measurement")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2, help="small/large alternations")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--router", default="quillcache")
    ap.add_argument(
        "--background-interval",
        type=float,
        default=1.0,
        help="the gateway's health_interval_s and scrape_interval_s (a diagnostic: a large "
        "value leaves only the request path in the routed figure)",
    )
    ap.add_argument("--only", choices=["routed", "idle"], default=None)
    ap.add_argument("--json", default=None, help="write every run here ('-': stdout)")
    args = ap.parse_args(argv)
    for flag in ("small", "large", "idle", "requests", "concurrency", "repeats"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag} must be at least 1")
    if args.idle_seconds <= 0 or args.background_interval <= 0:
        ap.error("--idle-seconds and --background-interval must be positive")
    global BACKGROUND_INTERVAL_S
    BACKGROUND_INTERVAL_S = args.background_interval
    out: dict[str, Any] = {"load_average_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="qc-fleet-") as tmp:
        workdir = Path(tmp)
        if args.only in (None, "routed"):
            runs: dict[str, list[dict[str, Any]]] = {"small": [], "large": []}
            for _ in range(args.repeats):
                for side in ("small", "large"):
                    n = getattr(args, side)
                    r = routed(workdir, n, args.requests, args.concurrency, args.router)
                    runs[side].append(r)
                    busy = {k: round(v, 2) for k, v in r["cores_busy"].items()}
                    print(
                        f"{n:5d} engines: {r['gateway_cpu_ms_per_request']:.3f} ms gateway CPU "
                        f"per request, {r['req_per_s']:.0f} req/s, {r['errors']} errors, "
                        f"{r['workers_served']} engines served, cores busy {json.dumps(busy)}, "
                        f"route latency us {json.dumps(r['route_latency_us'])}",
                        flush=True,
                    )
            small = sorted(r["gateway_cpu_ms_per_request"] for r in runs["small"])
            large = sorted(r["gateway_cpu_ms_per_request"] for r in runs["large"])
            ratio = large[len(large) // 2] / small[len(small) // 2]
            out["routed"] = {"runs": runs, "ratio_of_medians": ratio}
            print(f"large / small gateway CPU per request (medians): {ratio:.2f} (target <= 1.2)")
        if args.only in (None, "idle"):
            r = idle(workdir, args.idle, args.idle_seconds, args.router)
            out["idle"] = r
            print(
                f"idle, {args.idle} engines: gateway {100 * r['gateway_core_fraction']:.1f} % of a "
                f"core over {r['seconds']:.0f} s (target <= 10 %); engine-sim "
                f"{100 * r['engines_core_fraction']:.1f} %; {r['healthy_after']} healthy; "
                f"{r['gateway_threads']} threads, {r['gateway_fds']} fds",
                flush=True,
            )
    out["load_average_end"] = os.getloadavg()
    if args.json == "-":
        json.dump(out, sys.stdout, indent=2)
    elif args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
