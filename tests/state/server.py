"""A real `redis-server` (or `valkey-server`) process on a free 127.0.0.1 port, in a
temporary directory, for the shared-state tests and the benchmark."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


class ServerMissingError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path is None:
        package = binary  # Debian's package has the binary's name
        raise ServerMissingError(
            f"{binary} is not installed: the shared-state tests run against a real server; "
            f"install it with `apt-get install {package}` (`make deps` does; Valkey comes "
            "from bookworm-backports on Debian 12)"
        )
    return path


def _ping(port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One server process; `stop()` SIGKILLs it, `start()` again reuses the port (so a
    client's URL stays valid) and, with no persistence, comes back empty."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary = require(binary)
        self.name = binary
        self.workdir = workdir
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, *, same_port: bool = False) -> RedisServer:
        for _attempt in range(5):
            if not same_port:
                self.port = free_port()
            log = self.workdir / f"{self.name}-{self.port}.log"
            cmd = [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--save", "",
                "--appendonly", "no",
                "--dir", str(self.workdir),
                "--logfile", str(log),
                "--protected-mode", "no",
                "--daemonize", "no",
                "--maxmemory-policy", "noeviction",
            ]  # fmt: skip
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
            # a loaded host (load 10 and more) has taken over 10 s to start one
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                if _ping(self.port):
                    return self
                if self.proc.poll() is not None:
                    break
                time.sleep(0.01)
            self.stop()
            text = log.read_text() if log.exists() else ""
            if "Address already in use" in text and not same_port:
                continue  # the free port was taken in between: another one
            raise RuntimeError(f"{self.binary} did not start on port {self.port}:\n{text[-2000:]}")
        raise RuntimeError(f"{self.binary}: no free port after 5 attempts")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None
        deadline = time.monotonic() + 5
        while self.port and _ping(self.port) and time.monotonic() < deadline:
            time.sleep(0.01)

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
