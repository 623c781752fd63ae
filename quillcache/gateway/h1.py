"""uvicorn's httptools protocol, with the gateway's answers to bad HTTP.

What uvicorn does on its own, and what this changes:
- a request it cannot parse gets a text/plain 400: here OpenAI's JSON error shape;
- it takes request heads of any size: here a request line longer than `MAX_TARGET_BYTES`
  gets a 414, a head larger than `MAX_HEAD_BYTES` or with more than `MAX_HEADERS` fields
  a 431 (the native relay's limits, so both data paths answer alike);
- a client that shuts its sending side (`shutdown(SHUT_WR)`) is taken for gone, so it
  never gets its answer: here the end of input within `HALF_CLOSE_GRACE_S` of the
  request's last byte, before its answer started, is a half-close, and the answer still
  goes out (a body cut short by it reads as a 400); a later end of input still means the
  client left.
"""

from __future__ import annotations

import json
import time
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

# The native relay's limits (hyper: URIs up to 65,534 bytes; `max_header_size`,
# `max_headers` in rust/relay/src/server.rs).
MAX_TARGET_BYTES = 65_534
MAX_HEAD_BYTES = 128 << 10
MAX_HEADERS = 100
# A half-closing client shuts its side right behind its request's last byte; one that
# gives up waiting closes later. Same value as the relay's `HALF_CLOSE_GRACE`.
HALF_CLOSE_GRACE_S = 0.5

REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large"}


class _Refused(Exception):
    """Raised in a parser callback: httptools stops and uvicorn calls send_400_response."""


def error_head_and_body(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 answer in OpenAI's error shape; the connection closes after it."""
    kind = "BadRequestError" if status == 400 else REASONS[status].replace(" ", "")
    body = json.dumps(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}
    ).encode()
    head = (
        f"HTTP/1.1 {status} {REASONS[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class GatewayHttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refusal: tuple[int, str] | None = None
        self._head_bytes = 0
        self._header_count = 0
        self._last_data = 0.0
        self._half_closed = False
        self._cut_short: object = None  # the cycle whose body the end of input cut short

    def data_received(self, data: bytes) -> None:
        self._last_data = time.monotonic()
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        status, message = self._refusal or (400, f"malformed HTTP request: {msg}")
        self.transport.write(error_head_and_body(status, message))
        self.transport.close()

    # -- head limits ---------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = self._header_count = 0

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > MAX_TARGET_BYTES:
            self._refuse(414, f"request target longer than {MAX_TARGET_BYTES} bytes")
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        self._header_count += 1
        if self._head_bytes > MAX_HEAD_BYTES or self._header_count > MAX_HEADERS:
            self._refuse(
                431,
                f"request head larger than {MAX_HEAD_BYTES} bytes or with more than "
                f"{MAX_HEADERS} header fields",
            )
        super().on_header(name, value)

    def _refuse(self, status: int, message: str) -> None:
        self._refusal = (status, message)
        raise _Refused(message)

    # -- half-close ----------------------------------------------------------------------

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None:
            return
        receive = cycle.receive

        async def receive_unless_cut_short() -> Any:
            if self._cut_short is cycle:  # Starlette raises ClientDisconnect: a 400
                return {"type": "http.disconnect"}
            return await receive()

        # run_asgi reads `self.receive` when its task first runs, after this returns
        cycle.receive = receive_unless_cut_short  # type: ignore[method-assign]

    # asyncio's Protocol allows a bool (keep the transport open); uvicorn narrowed it to None
    def eof_received(self) -> bool | None:  # type: ignore[override]
        cycle = self.cycle
        in_flight = cycle is not None and not cycle.response_complete
        if (
            not in_flight
            # a half-closer shuts its side before an answer can reach it: one whose
            # (streamed) answer started has left
            or cycle.response_started
            or time.monotonic() - self._last_data > HALF_CLOSE_GRACE_S
        ):
            return None  # idle, or the client left: the transport closes
        self._half_closed = True
        if cycle.more_body:
            self._cut_short = cycle
            cycle.message_event.set()
        return True  # keep the sending side open for the answer

    def on_response_complete(self) -> None:
        queued = bool(self.pipeline)
        super().on_response_complete()
        if self._half_closed and not queued:
            self.transport.close()  # nothing more can come from a half-closed client
            self._unset_keepalive_if_required()
