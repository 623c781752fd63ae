"""Many simulated engines in one process (`engine-sim --engines N`).

A gateway in front of hundreds of engines is measured against simulators; one Python
process per engine would measure the simulators (and the host's two cores), not the
gateway. So one process serves N engines, each as faithful as a lone one: its own
HTTP port, its own engine model (KV cache, scheduler, counters, `/metrics`), its own
KV-event PUB and replay ROUTER socket. What they share is only what costs per engine
and is invisible from outside: one uvicorn server (one listening socket per engine; a
connection goes to the engine of the port it arrived on), one event loop, one ZMQ
context and one replay thread (`ReplayHub`).

Ports: engine i listens on `--port` + i (0: every engine a free port). A fixed KV-event
port gives engine i the base port + i * DP size (its rank r: + r), the same for the
replay endpoint; a wildcard port (`:*`, `:0`) gives every socket a free port. The ready
file lists every engine (`engines`: url, port, kv_endpoint, replay_endpoint), with
engine 0's address at the top level as for a lone engine.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from quillcache.errors import ConfigError

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_PORT = 65535
# per engine: its listening socket, PUB and ROUTER (each a listener and a mailbox), and a
# few client connections
FDS_PER_ENGINE = 8


class PortDispatch:
    """One ASGI app in front of one app per local port: a request goes to the app of the
    port its connection came in on (uvicorn's `scope["server"]`)."""

    def __init__(self, apps: dict[int, ASGIApp]) -> None:
        self.apps = apps

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":  # the engines' apps have no start-up of their own
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        server = scope.get("server")
        app = self.apps.get(server[1]) if server else None
        if app is None:  # cannot happen: every listening socket has its app
            raise RuntimeError(f"no engine listens on {server}")
        await app(scope, receive, send)


def offset_endpoint(endpoint: str, offset: int) -> str:
    """A ZMQ endpoint `offset` ports further (ipc/inproc: a suffix). A wildcard port
    (`:*`, `:0`) stays one: each socket binds a free port of its own."""
    if offset == 0 or endpoint.endswith((":*", ":0")):
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-{offset}"
    head, _, port = endpoint.rpartition(":")
    try:
        base = int(port)
    except ValueError:
        raise ConfigError(f"cannot offset the port of {endpoint!r}") from None
    if base + offset > MAX_PORT:
        raise ConfigError(
            f"{endpoint}: {offset + 1} ports from {base} go past {MAX_PORT}; "
            "use a lower base port or a wildcard port (tcp://127.0.0.1:*)"
        )
    return f"{head}:{base + offset}"


def check_counts(engines: int, port: int, dp_size: int) -> None:
    """A clear error for counts and port ranges that cannot work."""
    if engines < 1:
        raise ConfigError(f"--engines must be at least 1, got {engines}")
    if dp_size < 1:
        raise ConfigError(f"--data-parallel-size must be at least 1, got {dp_size}")
    if not 0 <= port <= MAX_PORT:
        raise ConfigError(f"--port must be in 0..{MAX_PORT}, got {port}")
    if port and port + engines - 1 > MAX_PORT:
        raise ConfigError(
            f"--port {port} + {engines} engines go past port {MAX_PORT}; "
            "use a lower base port or --port 0"
        )


def listen(host: str, port: int, engines: int) -> list[socket.socket]:
    """One listening socket per engine: `port` + i, or a free port each when 0."""
    raise_fd_limit(engines * FDS_PER_ENGINE)
    out: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        family = infos[0][0]
        for i in range(engines):
            p = port + i if port else 0
            sock = socket.socket(family, socket.SOCK_STREAM)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, p))
            except OSError as exc:
                raise ConfigError(f"engine {i}: cannot listen on {host}:{p}: {exc}") from None
            sock.listen(1024)
            sock.setblocking(False)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


def raise_fd_limit(needed: int) -> None:
    """Raise the soft open-files limit towards the hard one when `needed` is above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or needed + 64 <= soft:
        return
    target = needed + 64 if hard == resource.RLIM_INFINITY else min(hard, needed + 64)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(target, soft), hard))
    if target < needed:
        raise ConfigError(
            f"{needed} file descriptors needed, the hard limit is {hard} (ulimit -Hn)"
        )
