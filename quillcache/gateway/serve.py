"""Running a starlette app under uvicorn and announcing where it listens."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from quillcache.errors import ConfigError
from quillcache.gateway.config import GatewayConfig

if TYPE_CHECKING:
    from quillcache.gateway.relay import RelayHost

T = TypeVar("T")


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop when it is installed.

    uvicorn's `loop="auto"` only applies when uvicorn creates the loop itself; our servers
    start inside a running loop, so without this they ran on the stdlib selector loop
    (py-spy showed `_SelectorSocketTransport.write` among the gateway's top costs)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def announce(ready: dict[str, Any], ready_file: str | None) -> None:
    """Print `READY {json}` and write it atomically to `ready_file` (for launchers)."""
    if ready_file:
        with open(ready_file + ".tmp", "w") as f:
            json.dump(ready, f)
        os.replace(ready_file + ".tmp", ready_file)
    print("READY " + json.dumps(ready), flush=True)


async def serve_app(
    app: Any,
    host: str,
    port: int,
    log_level: str,
    extra: dict[str, Any],
    ready_file: str | None,
    on_started: Callable[[int], dict[str, Any]] | None = None,
) -> None:
    """Serve `app` until stopped. Once it listens: `on_started(port)` (whose result is
    announced instead) or the announcement of `host:port`."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=False,
            proxy_headers=False,  # nothing reads the client address; saves a middleware
            lifespan="auto",
            timeout_graceful_shutdown=2,
            # httptools when installed; the loop is the caller's (see `run_loop`)
            loop="none",
            http=_http_protocol(),
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        bound = server.servers[0].sockets[0].getsockname()[1]
        try:
            ready = (
                on_started(bound)
                if on_started
                else {"url": f"http://{host}:{bound}", "port": bound}
            )
        except BaseException:
            server.should_exit = True
            await task
            raise
        announce({**ready, **extra}, ready_file)
    await task


def _http_protocol() -> Any:
    """uvicorn's httptools protocol with the gateway's answers to bad HTTP (`h1`), else
    whatever uvicorn picks."""
    try:
        from quillcache.gateway.h1 import GatewayHttpProtocol
    except ImportError:  # no httptools
        return "auto"
    return GatewayHttpProtocol


def serve_gateway(config: GatewayConfig, ready_file: str | None = None) -> None:
    """Start the gateway (discovery, subscriptions) before listening, so a bad config or
    an unreachable engine fails with its own error instead of a server exit code."""
    from quillcache.gateway.app import Gateway
    from quillcache.gateway.relay import HOT_PATHS, RelayHost

    # The event ingestor is a thread: let the request loop take the GIL back within
    # 0.5 ms instead of the default 5 ms (routing p99 under an event flood).
    sys.setswitchinterval(0.0005)
    gateway = Gateway(config)

    async def main() -> None:
        try:
            await gateway.startup()
        except BaseException:
            await gateway.shutdown()  # close what startup opened before failing
            raise
        app = gateway.starlette(with_lifespan=False)
        host: RelayHost | None = None

        def start_relay(backend_port: int) -> dict[str, Any]:
            """The relay on the gateway's port, the Starlette app behind it on loopback."""
            nonlocal host
            from quillcache._native import Relay

            try:
                relay = Relay(
                    _ip_of(config.host),
                    config.port,
                    backend_port,
                    list(HOT_PATHS),
                    max_body_bytes=config.max_body_bytes,
                    connect_timeout_s=config.connect_timeout_s,
                    request_timeout_s=config.request_timeout_s,
                    stall_timeout_s=config.stall_timeout_s,
                    backend_key=gateway.relay_key,
                )
            except OSError as exc:  # e.g. the port is taken: the operator's to fix
                raise ConfigError(str(exc)) from None
            host = RelayHost(gateway, relay)
            host.start()
            return {"url": f"http://{config.host}:{relay.port}", "port": relay.port}

        try:
            if config.relay == "native":
                await serve_app(
                    app, "127.0.0.1", 0, config.log_level, {}, ready_file, on_started=start_relay
                )
            else:
                await serve_app(app, config.host, config.port, config.log_level, {}, ready_file)
        finally:
            if host is not None:
                host.stop()
            await gateway.shutdown()

    run_loop(main())


def _ip_of(host: str) -> str:
    """The relay binds an IP address: resolve a name such as `localhost`."""
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return host
    except OSError:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]  # type: ignore[return-value]
