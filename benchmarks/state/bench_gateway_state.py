"""What `--state redis://...` costs a gateway, end to end (issue 16 §4): the same
workload through a gateway with local state and one with shared state, side by side in
one run, in front of the same engine simulators, with a real `redis-server`.

    python -m benchmarks.state.bench_gateway_state [--engines 4] [--requests 2000] \\
        [--concurrency 8] [--rounds 3] [--replicas 2] [--baseline TREE] [--unix] [--slowlog] \\
        [--json out.json]

Per round, each gateway in turn gets `--requests` non-streamed completions (16-token
prompts of 8 blocks over 32 prefixes, 2 output tokens) from `--concurrency` client
threads; shared state runs `--replicas` replicas (the requests spread over them round
robin) so bookings meet other replicas' load, and the numbers are the replicas' sums.
With several replicas, as many replicas with local state each ("private") get the
same requests too: what N replicas cost without Redis (each one ingests every
engine's events and does its own idle work), so that shared / private is what Redis
itself costs.
`--baseline TREE`: as many shared replicas again, run from another source tree (e.g.
`git archive <commit> | tar -x -C TREE`, with the native module copied in), on the same
Redis under another key prefix: the code before a change beside the code after it, in
the same run ("shared-before"). `--unix`: as many shared replicas again, reaching the
same Redis through its Unix socket instead of TCP on 127.0.0.1 ("shared-unix"; Redis
on the gateway's host, e.g. a sidecar).
Measured per gateway:

- `pre_upstream` p50 (handler entry -> upstream request sent: parse, tokenize, hash,
  route and, with shared state, the booking), from `/admin/index`; the difference is
  what the Redis round trip adds to routing;
- the booking's own round trip p50, from `quillcache_state_booking_seconds`;
- the gateway processes' CPU time per request (`/proc/<pid>/stat` utime + stime),
  shared against local (summed over the replicas);
- Redis's own time per script call (`usec_per_call` of EVALSHA over the round);
- the floor: the p50 of a bare PING to the same Redis from a blocking socket in a
  process of its own (`rtt_probe`), every 2 ms during the round: what any round trip
  costs on this machine at that moment, under the same load;
- before the rounds, each gateway's CPU while idle (health checks, scrapes, and with
  shared state the polls and the heartbeat), per second: with several replicas that
  work is paid once per replica, and it is in the CPU per request.

Targets: routing p50 added <= 0.3 ms; CPU per request with shared state <= 1.3x local.
Run from the repo root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import redis

from quillcache.gateway.cli import ADMIN_TOKEN_ENV
from quillcache.up import Proc, engine_args, gateway_args, launch, launch_redis

ADMIN = "bench-admin"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def prompt(i: int) -> str:
    text = (f"[p{i % 32:02d}] " + "a context shared by the fleet " * 10)[:128]
    return text


def run_load(urls: list[str], requests: int, concurrency: int) -> None:
    clients = [httpx.Client(base_url=u, timeout=30.0) for u in urls]
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        r = clients[i % len(clients)].post(
            "/v1/completions", json={"model": "sim-model", "prompt": prompt(i), "max_tokens": 2}
        )
        if r.status_code != 200:
            with lock:
                errors.append(f"{r.status_code} {r.text[:200]}")

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(requests)))
    for c in clients:
        c.close()
    if errors:
        raise SystemExit(f"{len(errors)} requests failed, e.g. {errors[0]}")


def admin_index(url: str, reset: bool = False) -> dict[str, Any]:
    r = httpx.get(
        url + "/admin/index" + ("?reset_latency=1" if reset else ""),
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=10,
    )
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def booking_p50_us(url: str) -> float | None:
    """The median of quillcache_state_booking_seconds, from its buckets (upper bound)."""
    page = httpx.get(url + "/metrics", timeout=10).text
    buckets = []
    for line in page.splitlines():
        if line.startswith("quillcache_state_booking_seconds_bucket"):
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for upper, n in buckets:
        if n >= total / 2:
            return upper * 1e6
    return None


def start_probe(redis_url: str) -> subprocess.Popen[str]:
    port = redis_url.rsplit(":", 1)[1].split("/", 1)[0]
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.state.rtt_probe", "--port", port],
        stdout=subprocess.PIPE,
        text=True,
    )


def stop_probe(probe: subprocess.Popen[str]) -> dict[str, Any]:
    probe.send_signal(signal.SIGTERM)
    out, _ = probe.communicate(timeout=10)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def run_ns(pid: int) -> int:
    """Nanoseconds on a CPU of the process's live threads (`schedstat`: finer than the
    clock ticks of `stat`, which a few idle seconds do not fill)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just ended
            continue
    return total


def idle_cpu_ms_per_s(gateways: list[Proc], seconds: float) -> float:
    before = sum(run_ns(g.popen.pid) for g in gateways)
    time.sleep(seconds)
    return (sum(run_ns(g.popen.pid) for g in gateways) - before) / seconds / 1e6


def script_us(redis_url: str, reset: bool = False) -> float:
    """Redis's own time per script call (EVALSHA) since the last reset."""
    client = redis.Redis.from_url(redis_url)
    try:
        if reset:
            client.config_resetstat()
            return 0.0
        stats = client.info("commandstats").get("cmdstat_evalsha", {})
        return float(stats.get("usec_per_call", float("nan")))
    finally:
        client.close()


def slowlog(redis_url: str, start: bool) -> dict[str, Any]:
    """`--slowlog`: every command logged during a round (start=True resets it); at the
    end, the p50 of the script calls' own time in Redis and one of them."""
    client = redis.Redis.from_url(redis_url)
    try:
        if start:
            client.config_set("slowlog-log-slower-than", 0)
            client.config_set("slowlog-max-len", 1_000_000)
            client.slowlog_reset()
            return {}
        entries = client.slowlog_get(1_000_000)
        client.config_set("slowlog-log-slower-than", 10_000)
        scripts = sorted(
            (e for e in entries if e["command"].startswith(b"EVALSHA")),
            key=lambda e: e["duration"],
        )
        if not scripts:
            return {}
        mid = scripts[len(scripts) // 2]
        return {
            "script_p50_us": mid["duration"],
            "script_p90_us": scripts[len(scripts) * 9 // 10]["duration"],
            "script_example": mid["command"][:400].decode(errors="replace"),
        }
    finally:
        client.close()


def launch_redis_unix(work: Path, timeout_s: float = 10.0) -> Proc:
    """A `redis-server` on a free 127.0.0.1 port and a Unix socket in `work`, configured
    as `quillcache.up.launch_redis` configures its own."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise SystemExit("redis-server is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sock = work / "redis.sock"
    log_path = work / "redis.log"
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--unixsocket", str(sock)]
    argv += ["--unixsocketperm", "700", "--save", "", "--appendonly", "no", "--dir", str(work)]
    argv += ["--logfile", str(log_path), "--maxmemory-policy", "noeviction"]
    popen = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"redis://127.0.0.1:{port}/0"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if redis.Redis.from_url(url).ping():
                ready = {"url": url, "port": port, "unix_url": f"unix://{sock}?db=0"}
                return Proc("redis", popen, ready, log_path)
        except redis.RedisError:
            time.sleep(0.02)
    popen.kill()
    raise SystemExit(f"redis-server did not start (log: {log_path})")


def measure(gateways: list[Proc], args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    urls = [g.url for g in gateways]
    for u in urls:
        admin_index(u, reset=True)
    script_us(redis_url, reset=True)
    if args.slowlog:
        slowlog(redis_url, start=True)
    probe = start_probe(redis_url)
    before = sum(cpu_s(g.popen.pid) for g in gateways)
    started = time.perf_counter()
    run_load(urls, args.requests, args.concurrency)
    wall = time.perf_counter() - started
    cpu = sum(cpu_s(g.popen.pid) for g in gateways) - before
    floor = stop_probe(probe)
    p50s = [admin_index(u)["pre_upstream_us"]["p50"] for u in urls]
    logged = slowlog(redis_url, start=False) if args.slowlog else {}
    return {
        **logged,
        "pre_upstream_p50_us": statistics.median(p50s),
        "cpu_per_request_us": cpu / args.requests * 1e6,
        "requests_per_s": args.requests / wall,
        "ping_floor_p50_us": floor.get("p50_us", float("nan")),
        "redis_us_per_script": script_us(redis_url),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--idle-s", type=float, default=3.0, help="idle CPU measured this long")
    p.add_argument("--baseline", type=Path, default=None, help="a source tree to compare with")
    p.add_argument("--unix", action="store_true", help="shared replicas on the Unix socket too")
    p.add_argument(
        "--slowlog", action="store_true", help="the scripts' p50 in Redis from SLOWLOG too"
    )
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    os.environ[ADMIN_TOKEN_ENV] = ADMIN
    work = Path(tempfile.mkdtemp(prefix="bench-gateway-state-"))
    procs: list[Proc] = []
    try:
        redis = launch_redis(work) if not args.unix else launch_redis_unix(work)
        procs.append(redis)
        engines = [launch(f"engine{i}", engine_args(), work) for i in range(args.engines)]
        procs += engines
        urls = [e.url for e in engines]
        common = ["--tokenizer", "builtin", "--secret-file", str(work / "secret.json")]
        local = launch("local", gateway_args(urls, extra=common), work)
        procs.append(local)
        # with several replicas, as many with local state each ("private": what
        # independent replicas do), the same requests: what the replicas cost
        # without Redis (each one ingests every engine's events, and its own idle work)
        private = [local]
        for i in range(1, args.replicas):
            g = launch(f"private{i}", gateway_args(urls, extra=common), work)
            private.append(g)
            procs.append(g)
        sets: list[tuple[str, list[Proc]]] = [("local", [local])]
        if args.replicas > 1:
            sets.append(("private", private))
        shared: list[Proc] = []
        sets.append(("shared", shared))
        for i in range(args.replicas):
            g = launch(
                f"shared{i}", gateway_args(urls, extra=[*common, "--state", redis.url]), work
            )
            shared.append(g)
            procs.append(g)
        if args.baseline is not None:
            before: list[Proc] = []
            sets.append(("shared-before", before))
            for i in range(args.replicas):
                extra = [*common, "--state", redis.url, "--state-prefix", "before"]
                g = launch(f"before{i}", gateway_args(urls, extra=extra), work, tree=args.baseline)
                before.append(g)
                procs.append(g)
        if args.unix:
            unix: list[Proc] = []
            sets.append(("shared-unix", unix))
            for i in range(args.replicas):
                extra = [*common, "--state", redis.ready["unix_url"], "--state-prefix", "unix"]
                g = launch(f"unix{i}", gateway_args(urls, extra=extra), work)
                unix.append(g)
                procs.append(g)
        for _, gws in sets:  # warm-up
            run_load([g.url for g in gws], 200, args.concurrency)
        time.sleep(1.0)
        idle = {name: idle_cpu_ms_per_s(gws, args.idle_s) for name, gws in sets}
        print(json.dumps({"idle_cpu_ms_per_s": idle}), flush=True)
        rows: list[dict[str, Any]] = []
        for rnd in range(args.rounds):
            for name, gws in sets:
                m = measure(gws, args, redis.url)
                if name.startswith("shared"):
                    p50s = [booking_p50_us(g.url) for g in gws]
                    m["booking_p50_us_bucket"] = max(v for v in p50s if v is not None)
                rows.append({"round": rnd, "state": name, **m})
                print(json.dumps(rows[-1]), flush=True)
        for rnd in range(args.rounds):
            by = {r["state"]: r for r in rows if r["round"] == rnd}
            lo, sh = by["local"], by["shared"]
            added = sh["pre_upstream_p50_us"] - lo["pre_upstream_p50_us"]
            cpu_sh, cpu_lo = sh["cpu_per_request_us"], lo["cpu_per_request_us"]
            print(
                f"round {rnd}: routing p50 {sh['pre_upstream_p50_us']:.0f} / "
                f"{lo['pre_upstream_p50_us']:.0f} us, added {added:.0f} us (PING floor "
                f"p50 {sh['ping_floor_p50_us']:.0f} us; booking p50 <= "
                f"{sh['booking_p50_us_bucket']:.0f} us, of which Redis runs the script "
                f"{sh['redis_us_per_script']:.0f} us); CPU per request "
                f"{cpu_sh:.0f} / {cpu_lo:.0f} us = {cpu_sh / cpu_lo:.2f}x"
            )
            for other in ("shared-unix", "shared-before"):
                if other not in by:
                    continue
                bf = by[other]
                added_bf = bf["pre_upstream_p50_us"] - lo["pre_upstream_p50_us"]
                cpu_bf = bf["cpu_per_request_us"]
                print(
                    f"  {other}: routing p50 {bf['pre_upstream_p50_us']:.0f} "
                    f"us, added {added_bf:.0f} us (booking p50 <= "
                    f"{bf['booking_p50_us_bucket']:.0f} us, script "
                    f"{bf['redis_us_per_script']:.0f} us); CPU per request {cpu_bf:.0f} us = "
                    f"{cpu_bf / cpu_lo:.2f}x local"
                )
            if "private" in by:
                pv = by["private"]
                cpu_pv = pv["cpu_per_request_us"]
                print(
                    f"  {len(private)} private replicas: routing p50 "
                    f"{pv['pre_upstream_p50_us']:.0f} us; CPU per request {cpu_pv:.0f} us "
                    f"({cpu_pv / cpu_lo:.2f}x local); shared / private {cpu_sh / cpu_pv:.2f}x"
                )
        print(
            "idle CPU (ms/s, summed over the set): "
            + ", ".join(f"{name} {v:.1f}" for name, v in idle.items())
        )
        if args.json:
            Path(args.json).write_text(json.dumps({"idle": idle, "rounds": rows}, indent=1))
    finally:
        for proc in procs:
            proc.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
