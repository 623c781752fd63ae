"""Real Redis-protocol servers for the shared-state tests: `redis-server` always (the
test fails, saying what to install, when it is missing), and `valkey-server` too where
it is installed, and always under CI (`make deps` installs both)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.state.server import RedisServer, ServerMissingError

SERVERS = ["redis-server"]
if shutil.which("valkey-server") or os.environ.get("CI"):
    SERVERS.append("valkey-server")


@pytest.fixture(params=SERVERS)
def server_binary(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def redis_server(server_binary: str, tmp_path: Path) -> Iterator[RedisServer]:
    try:
        server = RedisServer(server_binary, tmp_path)
    except ServerMissingError as exc:
        pytest.fail(str(exc))
    server.start()
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.resume()  # a test that failed while the server was paused
        server.stop()
