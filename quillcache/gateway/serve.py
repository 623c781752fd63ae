"""`quillcache gateway`'s server: the gateway's start-up, then its port served by the
native relay (the Starlette app behind it on loopback) or by uvicorn."""

from __future__ import annotations

import socket
import sys
from typing import TYPE_CHECKING, Any

from quillcache.errors import ConfigError
from quillcache.gateway.config import GatewayConfig
from quillcache.serving import run_loop, serve_app

if TYPE_CHECKING:
    from quillcache.gateway.relay import RelayHost


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
            host = RelayHost(gateway.openai, relay)
            host.start()
            gateway.listening(relay.port)
            return {"url": f"http://{config.host}:{relay.port}", "port": relay.port}

        def started(port: int) -> dict[str, Any]:
            gateway.listening(port)
            return {"url": f"http://{config.host}:{port}", "port": port}

        try:
            if config.relay == "native":
                await serve_app(
                    app,
                    "127.0.0.1",
                    0,
                    config.log_level,
                    {},
                    ready_file,
                    on_started=start_relay,
                    http=_http_protocol(),
                )
            else:
                await serve_app(
                    app,
                    config.host,
                    config.port,
                    config.log_level,
                    {},
                    ready_file,
                    on_started=started,
                    http=_http_protocol(),
                )
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
