"""Forwarding one request to an engine and streaming the answer back unbuffered.

The upstream data path uses aiohttp: with many concurrent streams, httpx's connection
pool spent much of the gateway's CPU scanning idle connections (py-spy, see
docs/results/online.md); control calls (health, metrics, discovery) stay on httpx.

Upstream status codes and error bodies pass through unchanged. A streamed answer is
relayed chunk by chunk as the engine sends it; when the client goes away the
upstream response is closed (the engine sees the disconnect and aborts). If the
engine breaks mid-stream, the client gets an SSE `error` event instead of a silent
truncation (the `openai` client raises it as an APIError).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import AsyncGenerator, Callable
from typing import Any

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

FORWARDED_HEADERS = ("content-type", "accept", "x-request-id")


def sse_error(message: str) -> bytes:
    err = {"error": {"message": message, "type": "UpstreamError", "code": 502}}
    return b"data: " + json.dumps(err).encode() + b"\n\n"


def is_stream(resp: aiohttp.ClientResponse) -> bool:
    return "text/event-stream" in resp.headers.get("content-type", "")


async def read_all(resp: aiohttp.ClientResponse, stall_s: float) -> bytes:
    """A whole answer's body; each chunk must come within `stall_s` of the last one
    (TimeoutError otherwise)."""
    parts: list[bytes] = []
    while True:
        async with asyncio.timeout(stall_s):
            chunk = await resp.content.readany()
        if not chunk:
            return b"".join(parts)
        parts.append(chunk)


async def relay_stream(
    resp: aiohttp.ClientResponse,
    first: bytes,
    *,
    stall_s: float,
    on_first_byte: Callable[[], None],
    on_end: Callable[[BaseException | None], None],
    on_cached_tokens: Callable[[int], None] | None = None,
    relay_samples: collections.deque[float] | None = None,
) -> AsyncGenerator[bytes, None]:
    """Yield `first` (the body's first chunk, read already), then the rest of the upstream
    body as it arrives; an engine silent for `stall_s` ends the stream with an SSE error.
    Always closes upstream and calls `on_end`. `on_cached_tokens` gets the usage chunk's
    cached_tokens (`stream_options.include_usage`)."""
    failure: BaseException | None = None
    chunk = first
    try:
        if chunk:
            on_first_byte()
        while chunk:
            received = time.perf_counter()
            if on_cached_tokens is not None and b'"cached_tokens"' in chunk:
                cached = usage_cached_tokens(chunk)
                if cached is not None:
                    on_cached_tokens(cached)
            yield chunk  # returns once the server has written it to the client
            if relay_samples is not None:
                relay_samples.append(time.perf_counter() - received)
            # Scoped to the read alone: a timeout around the yield would cancel the
            # consumer's task, not this read.
            async with asyncio.timeout(stall_s):
                chunk = await resp.content.readany()
    except TimeoutError as exc:  # the engine hangs
        failure = exc
        yield sse_error(f"upstream engine failed mid-stream: no data for {stall_s:.1f} s")
    except aiohttp.ClientError as exc:  # engine died mid-stream
        failure = exc
        yield sse_error(f"upstream engine failed mid-stream: {type(exc).__name__}")
    except BaseException as exc:  # client went away (cancelled / generator closed)
        failure = exc
        raise
    finally:
        if failure is None:
            resp.release()  # complete: the connection goes back to the pool
        else:
            resp.close()  # unfinished: dropping the connection is how the engine learns
        on_end(failure)


async def until_disconnect(request: Request) -> None:
    """Return when the client disconnects (the body must have been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """Cancels the task that creates it when the client disconnects (its body must have
    been read). One watcher per request covers both the wait for the engine's headers
    (a non-streamed answer has none until it is complete) and the read of a
    non-streamed body; a streamed body is watched by `RelayResponse`. The owner catches
    the CancelledError, checks `client_left`, and always calls `stop()`.

    The watcher task only starts after `start_after_s`: a watcher that runs costs a
    receive() with its future and wake-ups (a few % of the gateway's CPU per short
    request, profiled at 64 concurrent requests, where queueing makes even a 1-token
    answer take ~100 ms), and most requests are answered within a second. A client that
    left earlier is still seen: its disconnect is the first thing the watcher receives,
    so an engine computes an abandoned answer for at most this long."""

    __slots__ = ("_request", "_task", "_timer", "_watcher", "client_left")

    start_after_s = 1.0

    def __init__(self, request: Request) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._request = request
        self.client_left = False
        self._watcher: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = asyncio.get_running_loop().call_later(
            self.start_after_s, self._start
        )

    def _start(self) -> None:
        self._timer = None
        self._watcher = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await until_disconnect(self._request)
        self.client_left = True
        self._task.cancel()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._watcher is not None:
            self._watcher.cancel()


def passthrough_response(
    resp: aiohttp.ClientResponse, content: bytes, extra: dict[str, str]
) -> Response:
    headers = {"content-type": resp.headers.get("content-type", "application/json"), **extra}
    return Response(content, status_code=resp.status, headers=headers)


class RelayResponse(Response):
    """An ASGI response that relays `stream` chunk by chunk, and stops it (closing the
    upstream) as soon as the client disconnects.

    Starlette's StreamingResponse does the same under ASGI spec < 2.4 (uvicorn says 2.3)
    with an anyio task group per response, a measurable share of the gateway's CPU at
    many streams (py-spy); here it is one watcher task."""

    def __init__(
        self, status_code: int, headers: dict[str, str], stream: AsyncGenerator[bytes, None]
    ) -> None:
        # not Response.__init__: there is no body to render, only a stream to relay
        self.status_code = status_code
        self.background = None
        self.raw_headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        self.stream = stream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        client_left = finished = False

        async def watch() -> None:
            nonlocal client_left
            while (await receive())["type"] != "http.disconnect":
                pass
            if not finished:
                client_left = True
                relay.cancel()

        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        watcher = asyncio.ensure_future(watch())
        try:
            async for chunk in self.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            finished = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not client_left:
                raise  # cancelled for another reason: propagate
            relay.uncancel()
        finally:
            finished = True
            watcher.cancel()
            await self.stream.aclose()  # upstream closed (or released) and on_end called


def streaming_response(
    resp: aiohttp.ClientResponse, stream: AsyncGenerator[bytes, None], extra: dict[str, str]
) -> RelayResponse:
    headers = {
        "content-type": resp.headers.get("content-type", "text/event-stream"),
        "cache-control": "no-cache",
        **extra,
    }
    return RelayResponse(resp.status, headers, stream)


def usage_cached_tokens(content: bytes) -> int | None:
    """usage.prompt_tokens_details.cached_tokens of a JSON completion or of the usage
    event in an SSE chunk, if present (a byte check first: most chunks have no usage)."""
    if b'"cached_tokens"' not in content:
        return None
    if content.startswith(b"data: "):
        for line in content.split(b"\n"):
            if line.startswith(b"data: ") and b'"cached_tokens"' in line:
                return _cached_tokens_of(line[6:])
        return None
    return _cached_tokens_of(content)


def _cached_tokens_of(content: bytes) -> int | None:
    try:
        data: Any = json.loads(content)
        return int(data["usage"]["prompt_tokens_details"]["cached_tokens"])
    except (ValueError, KeyError, TypeError):
        return None
