"""Fixtures that start real engine simulators and gateways as processes on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from quillcache.up import Proc, engine_args, gateway_args, launch

if TYPE_CHECKING:
    from tests.online.fleet import Fleet

ADMIN = "test-admin-token"


class Stack:
    """Processes of one test; every one is SIGKILLed at teardown. `relay`: the gateways'
    data path unless a test's config names one."""

    def __init__(self, workdir: Path, relay: str = "native") -> None:
        self.workdir = workdir
        self.relay = relay
        self.procs: list[Proc] = []
        self.engines: list[Proc] = []
        self.gateway: Proc | None = None

    def engine(self, name: str | None = None, extra: list[str] | None = None, **kw: object) -> Proc:
        name = name or f"engine{len(self.engines)}"
        proc = launch(name, engine_args(extra=extra or [], **kw), self.workdir)  # type: ignore[arg-type]
        self.procs.append(proc)
        self.engines.append(proc)
        return proc

    def start_gateway(self, config: dict[str, object] | None = None, extra: list[str] = ()) -> Proc:  # type: ignore[assignment]
        cfg = {
            "admin_token": ADMIN,
            "tokenizer": "builtin",
            "relay": self.relay,
            # this test's own secret, not the user's default file
            "secret_file": str(self.workdir / "gateway-secret.json"),
            **(config or {}),
        }
        path = self.workdir / f"gateway{len(self.procs)}.json"
        path.write_text(json.dumps(cfg))
        args = gateway_args(
            [e.url for e in self.engines if e.alive()], extra=["--config", str(path), *extra]
        )
        proc = launch(f"gateway{len(self.procs)}", args, self.workdir)
        self.procs.append(proc)
        self.gateway = proc
        return proc

    def admin(self) -> httpx.Client:
        assert self.gateway is not None
        return httpx.Client(
            base_url=self.gateway.url, timeout=10.0, headers={"authorization": f"Bearer {ADMIN}"}
        )

    def kill_all(self) -> None:
        for p in self.procs:
            p.kill()


def make_stack(tmp_path: Path, relay: str = "native") -> Iterator[Stack]:
    s = Stack(tmp_path, relay)
    try:
        yield s
    finally:
        s.kill_all()


def make_shared_stack(tmp_path: Path, relay: str = "native") -> Iterator[Stack]:
    """Two engines and a gateway (cache-aware router), shared by non-destructive tests."""
    s = Stack(tmp_path, relay)
    try:
        s.engine()
        s.engine()
        s.start_gateway({"router": "quillcache", "max_body_bytes": 65536})
        yield s
    finally:
        s.kill_all()


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A Redis, engines and gateway replicas sharing it (`tests/online/fleet.py`)."""
    from tests.online.fleet import Fleet

    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def shared_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    yield from make_shared_stack(tmp_path_factory.mktemp("online"))


def metric(text: str, name: str) -> float:
    """Sum of every sample of one metric in a Prometheus text page."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


Metric = Callable[[str, str], float]
