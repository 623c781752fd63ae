"""`quillcache up --engines N [--replicas R]`: N simulated engines and a gateway (or R
gateway replicas sharing their state through a `redis-server`) on 127.0.0.1.

The processes are real (`quillcache engine-sim`, `quillcache gateway`, `redis-server`)
and announce their addresses through a ready file (Redis: a PING), so nothing here
guesses ports. The engines bind their KV-event sockets and every replica subscribes to
every engine. The same launcher is used by the end-to-end tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quillcache.gateway.cli import ADMIN_TOKEN_ENV


class LaunchError(RuntimeError):
    """A child process did not come up (its output tail is in the message)."""


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    ready: dict[str, Any]
    log_path: Path

    @property
    def url(self) -> str:
        return str(self.ready["url"])

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: no goodbye, exactly like a crashed engine."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(timeout=5)

    def stop(self, timeout_s: float = 5.0) -> None:
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def launch(
    name: str,
    args: Sequence[str],
    workdir: Path,
    timeout_s: float = 20.0,
    tree: Path | None = None,
    module: str = "quillcache",
) -> Proc:
    """Start `python -m <module> <args> --ready-file ...` and wait for its READY.
    `tree`: run the quillcache of that source tree instead (a baseline to compare with)."""
    ready_file = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    ready_file.unlink(missing_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - the child owns it for its life
    popen = subprocess.Popen(
        [sys.executable, "-m", module, *args, "--ready-file", str(ready_file)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            **({"PYTHONPATH": str(tree)} if tree is not None else {}),
        },
        cwd=tree,  # `python -m` looks in the working directory first
    )
    log.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists():
            return Proc(name, popen, json.loads(ready_file.read_text()), log_path)
        if popen.poll() is not None:
            break
        time.sleep(0.05)
    if popen.poll() is None:
        popen.kill()
        popen.wait(timeout=5)
    tail = log_path.read_text(errors="replace")[-2000:]
    raise LaunchError(f"{name} did not start (exit {popen.returncode}):\n{tail}")


def engine_args(
    model: str = "sim-model", *, time_scale: float = 1.0, extra: Sequence[str] = ()
) -> list[str]:
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    return [
        "engine-sim",
        "--port",
        "0",
        "--model",
        model,
        "--time-scale",
        str(time_scale),
        "--kv-events-config",
        json.dumps(kv),
        *extra,
    ]


def gateway_args(urls: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
    out = ["gateway", "--port", "0"]
    for u in urls:
        out += ["--worker", u]
    return [*out, *extra]


@contextlib.contextmanager
def stack(
    engines: int,
    *,
    workdir: Path | None = None,
    engine_extra: Sequence[str] = (),
    gateway_extra: Sequence[str] = (),
    time_scale: float = 1.0,
    model: str = "sim-model",
) -> Iterator[tuple[list[Proc], Proc]]:
    """N engines and a gateway; every process is killed on exit, whatever happened."""
    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="quillcache-up-")
        workdir = Path(tmp.name)
    procs: list[Proc] = []
    try:
        for i in range(engines):
            procs.append(
                launch(
                    f"engine{i}",
                    engine_args(model, time_scale=time_scale, extra=engine_extra),
                    workdir,
                )
            )
        gateway = launch(
            "gateway", gateway_args([p.url for p in procs], extra=gateway_extra), workdir
        )
        procs.append(gateway)
        yield procs[:-1], gateway
    finally:
        for p in procs:
            p.kill()
        if tmp is not None:
            tmp.cleanup()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _pings(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def launch_redis(workdir: Path, timeout_s: float = 10.0) -> Proc:
    """A `redis-server` on a free 127.0.0.1 port, without persistence, evicting nothing
    (the shared state's sums must not lose a key: docs/state.md)."""
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        raise LaunchError(
            "redis-server is not installed: `apt-get install redis-server` (or valkey-server)"
        )
    for _attempt in range(5):
        port = _free_port()
        log_path = workdir / f"redis-{port}.log"
        popen = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(log_path),
                "--maxmemory-policy",
                "noeviction",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and popen.poll() is None:
            if _pings(port):
                ready = {"url": f"redis://127.0.0.1:{port}/0", "port": port}
                return Proc("redis", popen, ready, log_path)
            time.sleep(0.02)
        if popen.poll() is None:
            popen.kill()
            popen.wait(timeout=5)
        tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
        if "Address already in use" not in tail:
            raise LaunchError(f"redis-server did not start:\n{tail}")
    raise LaunchError("redis-server: no free port after 5 attempts")


@contextlib.contextmanager
def fleet_stack(
    engines: int,
    replicas: int,
    *,
    workdir: Path,
    engine_extra: Sequence[str] = (),
    gateway_extra: Sequence[str] = (),
    time_scale: float = 1.0,
    model: str = "sim-model",
) -> Iterator[tuple[Proc, list[Proc], list[Proc]]]:
    """Redis, N engines and R gateway replicas of one fleet (`--state redis://...`, one
    secret file); every process is killed on exit, whatever happened."""
    procs: list[Proc] = []
    try:
        redis = launch_redis(workdir)
        procs.append(redis)
        started = [
            launch(
                f"engine{i}", engine_args(model, time_scale=time_scale, extra=engine_extra), workdir
            )
            for i in range(engines)
        ]
        procs += started
        shared = ["--state", redis.url, "--secret-file", str(workdir / "gateway-secret.json")]
        gateways = []
        for i in range(replicas):  # one after the other: the first writes the secret
            g = launch(
                f"gateway{i}",
                gateway_args([p.url for p in started], extra=[*shared, *gateway_extra]),
                workdir,
            )
            procs.append(g)
            gateways.append(g)
        yield redis, started, gateways
    finally:
        for p in procs:
            p.kill()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--engines", type=int, default=2, help="how many simulated engines (default: 2)")
    a(
        "--replicas",
        type=int,
        default=1,
        help="gateway replicas (default: 1); above 1 they share their state through a "
        "redis-server started here (it must be installed)",
    )
    a("--model", default="sim-model", help="the model name the engines serve (default: sim-model)")
    a(
        "--router",
        default="quillcache",
        help="the gateway's router, a name or 'pkg.module:Class' (default: quillcache)",
    )
    a("--time-scale", type=float, default=1.0, help="engine latency multiplier (default: 1.0)")
    a(
        "--admin-token",
        default=None,
        help="bearer token of the gateway's /admin API (default: a random one, printed once)",
    )
    a("--workdir", default=None, help="where logs and ready files go (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    if args.engines < 1 or args.replicas < 1:
        print("up: --engines and --replicas must be at least 1", file=sys.stderr)
        return 2
    if not (math.isfinite(args.time_scale) and args.time_scale >= 0):
        print(
            f"up: --time-scale must be a finite number >= 0, got {args.time_scale}", file=sys.stderr
        )
        return 2
    if args.admin_token is not None and not args.admin_token.strip():
        print("up: --admin-token must not be empty (omit it for a random one)", file=sys.stderr)
        return 2
    # SIGTERM (systemd, `timeout`, CI) must stop the children too: make it unwind like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    admin_token = args.admin_token or secrets.token_urlsafe(24)
    # to the gateway through its environment, not its command line (`ps` shows that)
    os.environ[ADMIN_TOKEN_ENV] = admin_token
    tmp = None
    if args.workdir:
        workdir = Path(args.workdir)
        try:
            workdir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"up: cannot use --workdir {workdir}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    else:
        tmp = tempfile.TemporaryDirectory(prefix="quillcache-up-")
        workdir = Path(tmp.name)
    try:
        with contextlib.ExitStack() as running:
            redis: Proc | None = None
            if args.replicas > 1:
                redis, engines, gateways = running.enter_context(
                    fleet_stack(
                        args.engines,
                        args.replicas,
                        workdir=workdir,
                        time_scale=args.time_scale,
                        model=args.model,
                        gateway_extra=["--router", args.router],
                    )
                )
            else:
                engines, gateway = running.enter_context(
                    stack(
                        args.engines,
                        workdir=workdir,
                        time_scale=args.time_scale,
                        model=args.model,
                        gateway_extra=["--router", args.router],
                    )
                )
                gateways = [gateway]
            _announce(args, engines, gateways, redis, admin_token)
            # Redis may go (the replicas fail open to their own views, docs/state.md);
            # an engine or a gateway ending stops the stack
            watched = [*engines, *gateways]
            while all(p.alive() for p in watched):
                if redis is not None and not redis.alive():
                    print(
                        "up: redis exited; the replicas go on, each routing on its own view "
                        "(restart it on the same port and they share their state again)",
                        file=sys.stderr,
                        flush=True,
                    )
                    redis = None
                time.sleep(0.5)
            dead = [p.name for p in watched if not p.alive()]
            print(f"up: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            return 1
    except LaunchError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 1
    finally:
        if tmp is not None:
            tmp.cleanup()


def _announce(
    args: argparse.Namespace,
    engines: list[Proc],
    gateways: list[Proc],
    redis: Proc | None,
    admin_token: str,
) -> None:
    print(f"{len(engines)} engine simulator(s):")
    for e in engines:
        print(f"  {e.url}   (KV events {e.ready.get('kv_endpoint')})")
    if redis is not None:
        print(f"shared state: {redis.url}   (redis-server)")
    for i, g in enumerate(gateways):
        replica = f"replica {i}, " if len(gateways) > 1 else ""
        print(f"gateway: {g.url}   ({replica}router {args.router})")
    url = gateways[0].url
    if args.admin_token is None:
        print(f"admin token (printed once, not stored): {admin_token}")
    print()
    print("Try:")
    print(
        f"  curl -s {url}/v1/completions -H 'content-type: application/json' "
        f'-d \'{{"model": "{args.model}", "prompt": "Hello", "max_tokens": 8}}\''
    )
    print(f"  curl -s {url}/metrics | grep quillcache_")
    print(f"  curl -s -H 'Authorization: Bearer {admin_token}' {url}/admin/workers")
    print(f"  quillcache loadgen --url {url} --requests 200 --concurrency 16\n")
    print("Ctrl-C stops everything.", flush=True)
