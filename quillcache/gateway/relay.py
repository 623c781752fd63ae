"""The native data path: the Rust relay (`_native.Relay`) serves the clients, this decides.

With `relay: native` (the default) the relay listens on the gateway's port. A POST to
`/v1/completions` or `/v1/chat/completions` reaches `RelayHost` as an event with its
body read; the host checks, tokenizes, hashes and routes it exactly as the ASGI path
does (`OpenAIEndpoints.prepare` / `route`) and tells the relay where to send it. The
relay then relays the engine's answer frame by frame without coming back to Python
except to report its first byte, its usage chunk and its end. Every other request is
proxied by the relay to the gateway's Starlette app on a loopback port.

Why: a do-nothing Python proxy alone already used most of the gateway's TTFT budget at
64 streams (docs/results/online.md); the relay takes the HTTP parsing, the upstream
connection pool and every streamed chunk out of the interpreter.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers

from quillcache.gateway import eager, proxy
from quillcache.gateway.httpio import ApiError
from quillcache.gateway.openai_api import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    WORKER_HEADER,
    EngineError,
    OpenAIEndpoints,
    Prepared,
)

if TYPE_CHECKING:
    from quillcache._native import Relay
    from quillcache.gateway.workers import Worker

log = logging.getLogger(__name__)

HOT_PATHS = (COMPLETIONS, CHAT_COMPLETIONS)


@dataclass(slots=True)
class Flight:
    """A forwarded request, until the relay reports its end."""

    path: str
    headers: Headers
    prepared: Prepared
    worker: Worker
    retried: bool = False
    first_byte_s: float = 0.0  # the engine's first-byte limit (`OpenAIEndpoints.route`)


class RelayHost:
    """Answers the relay's events on the gateway's event loop."""

    def __init__(self, endpoints: OpenAIEndpoints, relay: Relay) -> None:
        self.endpoints = endpoints
        self.outcomes = endpoints.outcomes
        self.relay = relay
        self.flights: dict[int, Flight] = {}
        self._deciding: set[asyncio.Future[None]] = set()

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self.relay.fileno(), self.drain)

    def stop(self) -> None:
        asyncio.get_running_loop().remove_reader(self.relay.fileno())
        self.relay.stop()
        for task in self._deciding:
            task.cancel()

    def drain(self) -> None:
        for event in self.relay.take():
            try:
                self._dispatch(event)
            except Exception:  # one bad event must not stop the others
                log.exception("gateway relay: failed handling %s", event[0])

    def _dispatch(self, event: tuple[Any, ...]) -> None:
        kind, rid = event[0], event[1]
        if kind == "request":
            self._decide(rid, *event[2:])
        elif kind == "first_byte":
            flight = self.flights.get(rid)
            if flight is not None:
                route_id = flight.prepared.route_request.request_id
                self.outcomes.first_byte(flight.path, event[2], route_id)
        elif kind == "usage":
            cached = proxy.usage_cached_tokens(event[2])
            if cached is not None and rid in self.flights:
                self.outcomes.cached_tokens(cached)
        elif kind == "end":
            self._end(rid, *event[2:])
        elif kind == "upstream_failed":
            self._upstream_failed(rid, event[2], event[3], event[4])
        else:
            log.error("gateway relay: unknown event %r", kind)

    # -- deciding ------------------------------------------------------------------------

    def _decide(
        self,
        rid: int,
        path: str,
        raw_headers: list[tuple[str, bytes]],
        body: bytes,
        waited: float,
        peer: str,
    ) -> None:
        """Decide in the fd callback when the gateway tokenizes locally; else in a task
        that awaits the engine's /tokenize."""
        started = time.perf_counter() - waited
        headers = Headers(raw=[(k.encode("latin-1"), v) for k, v in raw_headers])
        chat = path == CHAT_COMPLETIONS
        try:
            tenant = self.endpoints.authenticate(headers, peer)
            prepared = self.endpoints.prepare_now(headers, body, chat, tenant)
        except Exception as exc:
            self._answer_failure(rid, path, exc)
            return
        if prepared is not None:
            self._send(rid, Flight(path, headers, prepared, None), started)  # type: ignore[arg-type]
            return
        task = asyncio.ensure_future(self._decide_later(rid, path, headers, body, started, tenant))
        self._deciding.add(task)
        task.add_done_callback(self._deciding.discard)

    async def _decide_later(
        self, rid: int, path: str, headers: Headers, body: bytes, started: float, tenant: str
    ) -> None:
        try:
            prepared = await self.endpoints.prepare(headers, body, path == CHAT_COMPLETIONS, tenant)
        except Exception as exc:
            self._answer_failure(rid, path, exc)
            return
        self._send(rid, Flight(path, headers, prepared, None), started)  # type: ignore[arg-type]

    def _answer_failure(self, rid: int, path: str, exc: Exception) -> None:
        if not isinstance(exc, ApiError):
            log.error("gateway relay: unhandled error on %s", path, exc_info=exc)
            exc = _internal(exc)
        self._answer_error(rid, path, exc)

    def _send(self, rid: int, flight: Flight, started: float | None = None) -> None:
        """Route `flight` and hand it to the relay, or answer why not. Every failure is
        answered: an unanswered request would wait for the relay's timeout."""
        try:
            self._route_and_forward(rid, flight, started)
        except Exception as exc:
            if self.flights.pop(rid, None) is not None:
                self.outcomes.released(flight.prepared.route_request.request_id)
            self._answer_failure(rid, flight.path, exc)

    def _route_and_forward(self, rid: int, flight: Flight, started: float | None) -> None:
        # the booking in Redis (a round trip) or the SLO queue's wait: routed (and
        # booked) from here, forwarded from the reply's read callback or the queue's
        # release (`eager`: no loop turn before either)
        if self.endpoints.shared is not None or self.endpoints.slo_queue is not None:
            fut: asyncio.Future[None] = eager.start(self._book_and_forward(rid, flight, started))
        else:
            worker, dp_rank, first_byte_s = self.endpoints.route(flight.prepared)
            self._forward(rid, flight, started, worker, dp_rank, first_byte_s)
            return
        if not fut.done():
            self._deciding.add(fut)
            fut.add_done_callback(self._deciding.discard)

    async def _book_and_forward(self, rid: int, flight: Flight, started: float | None) -> None:
        """`_send`'s shared-state path: route, book, forward; every failure answered."""
        try:
            worker, dp_rank, first_byte_s = await self.endpoints.route_booked(
                flight.prepared, cancellable=False
            )
            self._forward(rid, flight, started, worker, dp_rank, first_byte_s)
        except Exception as exc:
            if self.flights.pop(rid, None) is not None:
                self.outcomes.released(flight.prepared.route_request.request_id)
            self._answer_failure(rid, flight.path, exc)

    def _forward(
        self,
        rid: int,
        flight: Flight,
        started: float | None,
        worker: Worker,
        dp_rank: int,
        first_byte_s: float,
    ) -> None:
        outcomes = self.outcomes
        flight.worker = worker
        flight.first_byte_s = first_byte_s
        route_id = flight.prepared.route_request.request_id
        if not worker.url.startswith("http://"):
            # The relay speaks plain HTTP; the ASGI path (aiohttp) serves https engines.
            outcomes.released(route_id)
            self.flights.pop(rid, None)
            self.relay.delegate(rid)
            return
        if started is not None:
            outcomes.forwarding(time.perf_counter() - started)
        upstream = self.endpoints.upstream_headers(flight.headers, worker, dp_rank)
        self.flights[rid] = flight
        if not self.relay.forward(
            rid,
            worker.url + flight.path,
            [(k, v.encode("latin-1")) for k, v in upstream.items()],
            flight.prepared.raw,
            [(WORKER_HEADER, str(worker.id).encode())],
            first_byte_s,
        ):  # the client left while it was being decided
            self.flights.pop(rid, None)
            outcomes.client_left(route_id)
            outcomes.answered(flight.path, 499)

    def _answer_error(self, rid: int, path: str, exc: ApiError) -> None:
        response = exc.response()
        self.outcomes.answered(path, exc.status)
        headers = [
            (k, v.encode("latin-1")) for k, v in response.headers.items() if k != "content-length"
        ]
        self.relay.respond(rid, exc.status, headers, bytes(response.body))

    # -- what the relay reports ------------------------------------------------------------

    def _upstream_failed(self, rid: int, connect: bool, message: str, timed_out: bool) -> None:
        """No answer head from the engine (or no first frame of a stream): retry a failed
        connect or a hung engine once elsewhere (as the ASGI path does), else a 502/504.
        Either way the client got nothing yet."""
        flight = self.flights.get(rid)
        if flight is None:
            return
        worker, route_id = flight.worker, flight.prepared.route_request.request_id
        error: ApiError
        if connect or timed_out:
            reason = "connect failed" if connect else "hung"
            retry = not flight.retried  # the down worker is not routable any more
            self.outcomes.engine_failed(route_id, worker.id, f"{reason}: {message}", retry=retry)
            if retry:
                flight.retried = True
                self._send(rid, flight)
                return
            if connect:
                error = EngineError(
                    worker, 502, f"engine {worker.url} unreachable: {message}", "APIConnectionError"
                )
            else:
                error = EngineError(
                    worker, 504, f"engine {worker.url}: {message}", "APITimeoutError"
                )
        else:
            self.outcomes.released(route_id)
            error = EngineError(worker, 502, f"engine {worker.url} failed: {message}")
        self.flights.pop(rid, None)
        self._answer_error(rid, flight.path, error)

    def _end(
        self, rid: int, status: int, streamed: bool, outcome: str, detail: str, elapsed: float
    ) -> None:
        flight = self.flights.pop(rid, None)
        if flight is None:
            return
        broke = None
        if outcome == "upstream_failed":
            broke = f"broke {'mid-stream' if streamed else 'mid-response'}: {detail}"
        self.outcomes.ended(
            flight.path,
            flight.prepared.route_request.request_id,
            flight.worker.id,
            elapsed,
            broke=broke,
            client_left=outcome == "client_left",
        )
        self.outcomes.answered(flight.path, status)


def _internal(exc: Exception) -> ApiError:
    return ApiError(500, f"internal gateway error: {type(exc).__name__}", "InternalServerError")
