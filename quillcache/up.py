"""`quillcache up --engines N`: N simulated engines and a gateway on 127.0.0.1.

The processes are real (`quillcache engine-sim`, `quillcache gateway`) and announce
their addresses through a ready file, so nothing here guesses ports. The same
launcher is used by the end-to-end tests.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
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


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--engines", type=int, default=2, help="how many simulated engines")
    a("--model", default="sim-model", help="the model name the engines serve")
    a("--router", default="quillcache", help="the gateway's router (a name or 'pkg.module:Class')")
    a("--time-scale", type=float, default=1.0, help="engine latency multiplier")
    a(
        "--admin-token",
        default=None,
        help="bearer token of the gateway's /admin API (default: a random one, printed once)",
    )
    a("--workdir", default=None, help="where logs and ready files go (default: a temp dir)")


def run(args: argparse.Namespace) -> int:
    if args.engines < 1:
        print("up: --engines must be at least 1", file=sys.stderr)
        return 2
    # SIGTERM (systemd, `timeout`, CI) must stop the children too: make it unwind like Ctrl-C.
    signal.signal(signal.SIGTERM, _interrupt)
    admin_token = args.admin_token or secrets.token_urlsafe(24)
    # to the gateway through its environment, not its command line (`ps` shows that)
    os.environ[ADMIN_TOKEN_ENV] = admin_token
    workdir = Path(args.workdir) if args.workdir else None
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    try:
        with stack(
            args.engines,
            workdir=workdir,
            time_scale=args.time_scale,
            model=args.model,
            gateway_extra=["--router", args.router],
        ) as (engines, gateway):
            print(f"{len(engines)} engine simulator(s):")
            for e in engines:
                print(f"  {e.url}   (KV events {e.ready.get('kv_endpoint')})")
            print(f"gateway: {gateway.url}   (router {args.router})")
            if args.admin_token is None:
                print(f"admin token (printed once, not stored): {admin_token}")
            print()
            print("Try:")
            print(
                f"  curl -s {gateway.url}/v1/completions -H 'content-type: application/json' "
                f'-d \'{{"model": "{args.model}", "prompt": "Hello", "max_tokens": 8}}\''
            )
            print(f"  curl -s {gateway.url}/metrics | grep quillcache_")
            print(f"  curl -s -H 'Authorization: Bearer {admin_token}' {gateway.url}/admin/workers")
            print(f"  quillcache loadgen --url {gateway.url} --requests 200 --concurrency 16\n")
            print("Ctrl-C stops everything.", flush=True)
            while all(p.alive() for p in [*engines, gateway]):
                time.sleep(0.5)
            dead = [p.name for p in [*engines, gateway] if not p.alive()]
            print(f"up: {', '.join(dead)} exited; stopping the rest", file=sys.stderr)
            return 1
    except LaunchError as exc:
        print(f"up: {exc}", file=sys.stderr)
        return 1
