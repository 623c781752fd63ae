"""The least a Python proxy can do: relay a request and its streamed answer, nothing else.

`bench_online --only overhead --floor` runs it as a side of the overhead phase, built
from the same parts as the gateway (uvicorn with httptools on uvloop, an aiohttp client
with a connection pool) but without parsing, tokenizing, hashing, routing or metrics:
what it adds to TTFT is the cost of the extra hop itself on this machine, the floor
under any gateway written this way.

    python -m benchmarks.online.floor_proxy --upstream http://127.0.0.1:8001 --port 0
"""

from __future__ import annotations

import argparse
from typing import Any

import aiohttp

from quillcache.serving import run_loop, serve_app


class FloorProxy:
    """An ASGI app that forwards every POST body to `upstream` and relays the answer."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        if self.session is None:
            self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        async with self.session.request(
            scope["method"],
            self.upstream + scope["path"],
            data=body,
            headers={"content-type": "application/json"},
        ) as resp:
            content_type = resp.headers.get("content-type", "application/json").encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": resp.status,
                    "headers": [(b"content-type", content_type)],
                }
            )
            async for chunk in resp.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--upstream", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--ready-file", default=None)
    args = p.parse_args(argv)
    app = FloorProxy(args.upstream)
    run_loop(serve_app(app, args.host, args.port, "error", {}, args.ready_file))


if __name__ == "__main__":
    main()
