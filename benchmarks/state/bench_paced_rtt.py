"""What a sparse round trip costs on this machine: the same Redis calls sent back to back
and paced (one every `--intervals` ms), their round trip as the client sees it and their
time inside Redis (`SLOWLOG`), side by side in one run on one `redis-server`.

    python -m benchmarks.state.bench_paced_rtt [--calls 2000] [--intervals 0 1 4] [--json F]

Why it exists (issue 16 §4): a gateway at a few hundred requests per second sends one
booking every few milliseconds, and between two of them Redis and the gateway sleep. On
a VM that wake-up and the cold caches after it are paid on every call; a benchmark that
sends calls back to back never pays them. The calls:

- `ping`: a bare PING (no script);
- `return1`: `EVALSHA` of `return 1` (the fixed cost of running a script);
- `keyspace`: `EVALSHA` of a script shaped like the booking (reads its arguments, `TIME`,
  one `ZADD`, one `HMGET` and one `HSET` of four fields, one `SET ... PX`).

The client is a blocking socket with the `hiredis` parser (the cheapest there is), so
the client side adds as little as it can. Run from the repo root.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import hiredis
import numpy as np
import redis

from benchmarks.state.rtt_probe import round_trip
from quillcache.up import launch_redis

RETURN1 = "return 1"
KEYSPACE = r"""
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZADD', 'bench:leases', ms + 3000, ARGV[1])
local f = {ARGV[2] .. '|n', ARGV[2] .. '|q', ARGV[3] .. '|n', ARGV[3] .. '|q'}
local v = redis.call('HMGET', 'bench:load', f[1], f[2], f[3], f[4])
local n = (tonumber(v[1]) or 0) + 1
local q = (tonumber(v[2]) or 0) + tonumber(ARGV[4])
redis.call('HSET', 'bench:load', f[1], n, f[2], q, f[3], tonumber(v[3]) or 0, f[4], 0)
redis.call('SET', 'bench:spec:' .. ARGV[5], ARGV[2] .. '=' .. (ms + 10000), 'PX', 10000)
return {n, q}
"""


def command(*parts: str | int) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for p in parts:
        b = str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def round_trips(sock: socket.socket, payload: bytes, calls: int, interval_s: float) -> list[float]:
    """`calls` round trips of `payload`, one every `interval_s` (0: back to back); µs."""
    reader = hiredis.Reader()
    out: list[float] = []
    next_at = time.perf_counter()
    for _ in range(calls):
        if interval_s > 0:
            next_at += interval_s
            pause = next_at - time.perf_counter()
            if pause > 0:
                time.sleep(pause)
        started = time.perf_counter()
        reply = round_trip(sock, reader, payload)
        out.append((time.perf_counter() - started) * 1e6)
        if isinstance(reply, hiredis.ReplyError):
            raise RuntimeError(f"redis: {reply}")
    return out


def inside_redis_us(client: redis.Redis, name: bytes) -> float:
    """The p50 of the logged calls' own time in Redis (SLOWLOG), for commands `name`."""
    entries = client.slowlog_get(1_000_000)
    durations = [e["duration"] for e in entries if e["command"].split(b" ")[0] == name]
    client.slowlog_reset()
    return float(np.percentile(durations, 50)) if durations else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--intervals", type=float, nargs="+", default=[0.0, 1.0, 4.0])
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="qc-paced-") as tmp:
        proc = launch_redis(Path(tmp))
        try:
            client = redis.Redis.from_url(proc.url)
            shas = {
                "return1": client.script_load(RETURN1),
                "keyspace": client.script_load(KEYSPACE),
            }
            client.config_set("slowlog-log-slower-than", 0)
            client.config_set("slowlog-max-len", 1_000_000)
            port = redis.connection.parse_url(proc.url)["port"]
            sock = socket.create_connection(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            payloads = {
                "ping": command("PING"),
                "return1": command("EVALSHA", shas["return1"], 0),
                "keyspace": command("EVALSHA", shas["keyspace"], 0, "r1", "e1:0", "e2:0", 96, "a1"),
            }
            rows: list[dict[str, Any]] = []
            print(f"{'call':<10}{'every':>10}{'round trip p50':>16}{'p90':>10}{'in redis p50':>14}")
            for interval in args.intervals:
                for name, payload in payloads.items():
                    round_trips(sock, payload, 200, 0.0)  # warm
                    client.slowlog_reset()
                    rtt = round_trips(sock, payload, args.calls, interval / 1000)
                    cmd = b"PING" if name == "ping" else b"EVALSHA"
                    row = {
                        "call": name,
                        "interval_ms": interval,
                        "rtt_p50_us": float(np.percentile(rtt, 50)),
                        "rtt_p90_us": float(np.percentile(rtt, 90)),
                        "in_redis_p50_us": inside_redis_us(client, cmd),
                    }
                    rows.append(row)
                    every = "back2back" if interval == 0 else f"{interval:g} ms"
                    print(
                        f"{name:<10}{every:>10}{row['rtt_p50_us']:>14.0f}µs"
                        f"{row['rtt_p90_us']:>8.0f}µs{row['in_redis_p50_us']:>12.0f}µs"
                    )
            sock.close()
            client.close()
        finally:
            proc.stop()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
