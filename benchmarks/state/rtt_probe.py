"""The floor of a Redis round trip on this machine, under whatever load it carries:
a PING every `--interval-ms` from a blocking socket (the cheapest client there is),
timed until SIGTERM or SIGINT, then one JSON line on stdout with the percentiles.

    python -m benchmarks.state.rtt_probe --port 6379 [--host 127.0.0.1] [--interval-ms 2]

`bench_gateway_state` runs it beside each measured round, so that the routing time a
gateway's booking adds can be read against what any round trip costs at that moment.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import sys
import time
from typing import Any

import hiredis
import numpy as np

PING = b"*1\r\n$4\r\nPING\r\n"


def round_trip(sock: socket.socket, reader: hiredis.Reader, payload: bytes) -> Any:
    """Send `payload` (one command) and read its reply off a blocking socket."""
    sock.sendall(payload)
    reply: Any = False
    while reply is False:
        data = sock.recv(65536)
        if not data:
            raise ConnectionError("redis closed the connection")
        reader.feed(data)
        reply = reader.gets()
    return reply


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--interval-ms", type=float, default=2.0)
    args = p.parse_args(argv)
    stop = False

    def on_signal(_sig: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    sock = socket.create_connection((args.host, args.port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = hiredis.Reader()
    samples: list[float] = []
    while not stop:
        started = time.perf_counter()
        round_trip(sock, reader, PING)
        samples.append(time.perf_counter() - started)
        time.sleep(args.interval_ms / 1000)
    us = np.asarray(samples) * 1e6
    out: dict[str, float] = {"pings": len(samples)}
    if len(us):
        out |= {f"p{q}_us": round(float(np.percentile(us, q)), 1) for q in (50, 90, 99)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
