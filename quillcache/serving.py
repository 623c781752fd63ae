"""Running a Starlette app under uvicorn on the caller's loop, and announcing where it
listens: the gateway, the engine simulator and the benchmark harness all serve this way."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

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
    http: Any = "auto",
    sockets: list[Any] | None = None,
) -> None:
    """Serve `app` until stopped. Once it listens: `on_started(port)` (whose result is
    announced instead) or the announcement of `host:port`. `http`: uvicorn's protocol
    (the gateway passes its own answers to bad HTTP, `gateway.h1`). `sockets`: listen on
    these bound sockets instead of `host:port` (one server, many ports: the port
    announced is the first socket's)."""
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
            http=http,
        )
    )
    task = asyncio.create_task(server.serve(sockets=sockets))
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
