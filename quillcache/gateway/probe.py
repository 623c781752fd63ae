"""The gateway's background requests to its engines: `GET /health` and `GET /metrics`,
every second, for every engine.

That is O(fleet) work whatever the traffic, so it must cost little per engine: at 1,024
engines it is 2,048 requests a second. httpx scans its whole connection pool on every
request (O(engines) each, so O(engines²) a second) and aiohttp's per-request interpreter
cost is several times what a round needs here (docs/results/online.md). Here each
engine has one keep-alive HTTP/1.1 connection (`EngineProbe`, an asyncio protocol with
httptools' parser; opened once, reopened after a failure), and a round (`fetch_all`)
writes one pre-built request on every connection and collects the answers from the
protocol callbacks: no task, lock or timeout object per engine, one future per round.

Requests on one connection go one after the other (never pipelined): a health round and
a scrape round may overlap. An engine that has not answered when the round's time is up
counts as failed and its connection is closed (its late answer cannot be mistaken for
the next one). A kept-alive connection the engine closed meanwhile (its idle timeout)
fails before any byte of the answer: the request is retried once on a new connection,
since that says nothing about the engine.
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import Callable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

from quillcache.connectors.engine_metrics import (
    RANK_FIELDS,
    RANK_LABEL,
    EngineLoad,
    set_rank_values,
)

MAX_BODY = 64 << 20  # a /metrics page far larger than any engine's
Result = tuple[int, bytes] | BaseException  # (status, body), or why there is none
Done = Callable[[Result], None]


class ProbeError(OSError):
    """The engine could not be reached, or answered something that is not HTTP/1.1."""


class _Conn(asyncio.Protocol):
    """One connection of a probe; events of a connection the probe dropped are ignored."""

    def __init__(self, probe: EngineProbe) -> None:
        self.probe = probe
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.probe._made(self)

    def data_received(self, data: bytes) -> None:
        if self.probe._conn is self:
            self.probe._data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.probe._conn is self:
            self.probe._lost()


class EngineProbe:
    """GET requests to one engine over one keep-alive connection, one at a time."""

    def __init__(self, url: str, connect_timeout_s: float = 2.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"EngineProbe speaks plain http://, not {url!r}")
        self.host = parts.hostname
        self.port = parts.port or 80
        self.prefix = parts.path.rstrip("/")
        self._host_header = parts.netloc.encode()
        self.connect_timeout_s = connect_timeout_s
        self._requests: dict[str, bytes] = {}
        self._conn: _Conn | None = None
        self._connecting: asyncio.Task[None] | None = None
        self._parser: Any = None
        self._pending: collections.deque[tuple[str, Done, bool]] = collections.deque()
        self._inflight: tuple[str, Done, bool] | None = None
        self._reused = False  # the in-flight request went on a connection used before
        self._got_bytes = False
        self._status = 0
        self._body: list[bytes] = []
        self._body_len = 0
        self._done = False
        self._keep = False
        self.connects = 0  # connections opened (1 while the engine stays up)
        self.closed = False

    def _request(self, path: str) -> bytes:
        req = self._requests.get(path)
        if req is None:
            req = b"GET %s HTTP/1.1\r\nhost: %s\r\naccept: */*\r\n\r\n" % (
                (self.prefix + path).encode(),
                self._host_header,
            )
            self._requests[path] = req
        return req

    # -- requests --------------------------------------------------------------------

    def submit(self, path: str, done: Done) -> None:
        """Send `GET path` when the connection is free; `done` gets the result."""
        if self.closed:
            done(ProbeError("probe closed"))
            return
        self._pending.append((path, done, False))
        self._pump()

    async def get(self, path: str, timeout_s: float = 2.0) -> tuple[int, bytes]:
        """One request on its own (tests, tools): `ProbeError` or `TimeoutError`."""
        result = (await fetch_all({0: self}, path, timeout_s))[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def _pump(self) -> None:
        if self._inflight is not None or not self._pending:
            return
        conn = self._conn
        if conn is None or conn.transport is None:
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            return
        self._inflight = self._pending.popleft()
        self._got_bytes = False
        self._status, self._body, self._body_len, self._done = 0, [], 0, False
        conn.transport.write(self._request(self._inflight[0]))

    async def _connect(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                await loop.create_connection(lambda: _Conn(self), self.host, self.port)
        except (OSError, TimeoutError) as exc:
            self._connecting = None
            self._fail_all(ProbeError(f"cannot connect to {self.host}:{self.port}: {exc}"))
            return
        self._connecting = None
        self.connects += 1
        self._pump()

    def _fail_all(self, exc: BaseException) -> None:
        items = [self._inflight] if self._inflight is not None else []
        items += list(self._pending)
        self._inflight = None
        self._pending.clear()
        for _, done, _ in items:
            done(exc)

    def abort(self, exc: BaseException) -> None:
        """Drop the connection; every request waiting on it fails with `exc`."""
        self._drop_connection()
        self._fail_all(exc)

    def close(self) -> None:
        self.closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            self._connecting = None
        self.abort(ProbeError("probe closed"))

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
        self._reused = False

    # -- the connection's events ---------------------------------------------------------

    def _made(self, conn: _Conn) -> None:
        if self.closed:
            assert conn.transport is not None
            conn.transport.close()
            return
        self._drop_connection()
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self._reused = False

    def _lost(self) -> None:
        self._conn = None
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            path, done, retried = inflight
            if self._reused and not self._got_bytes and not retried:
                self._pending.appendleft((path, done, True))  # the engine's idle close
            else:
                done(ProbeError("connection closed by the engine"))
        self._reused = False
        if not self.closed:
            self._pump()

    def _data(self, data: bytes) -> None:
        if self._inflight is None:
            self.abort(ProbeError("bytes from the engine with no request in flight"))
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.abort(ProbeError("unexpected protocol upgrade"))
            return
        except (httptools.HttpParserError, ProbeError) as exc:
            self.abort(ProbeError(f"unreadable answer: {exc}"))
            return
        if self._done:
            _, done, _ = self._inflight
            self._inflight = None
            keep = self._keep
            done((self._status, b"".join(self._body)))
            if keep:
                self._parser = httptools.HttpResponseParser(self)
                self._reused = True
            else:
                self._drop_connection()
            self._pump()

    # -- httptools callbacks ------------------------------------------------------------

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body_len += len(body)
        if self._body_len > MAX_BODY:
            raise ProbeError("body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._done = True
        self._keep = self._parser.should_keep_alive()  # only valid until it returns


async def fetch_all(
    probes: Mapping[int, EngineProbe], path: str, timeout_s: float = 2.0
) -> dict[int, Result]:
    """`GET path` on every probe at once; each result within `timeout_s`, else a
    `TimeoutError` (and that probe's connection is dropped)."""
    loop = asyncio.get_running_loop()
    results: dict[int, Result] = {}
    if not probes:
        return results
    all_in: asyncio.Future[None] = loop.create_future()
    expected = len(probes)

    def finisher(key: int) -> Done:
        def done(result: Result) -> None:
            if key in results:
                return
            results[key] = result
            if len(results) == expected and not all_in.done():
                all_in.set_result(None)

        return done

    for key, probe in probes.items():
        probe.submit(path, finisher(key))
    if len(results) < expected:

        def time_up() -> None:
            if not all_in.done():
                all_in.set_result(None)

        handle = loop.call_later(timeout_s, time_up)
        try:
            await all_in
        finally:
            handle.cancel()
    for key, probe in probes.items():
        if key not in results:
            results[key] = TimeoutError(f"no answer to GET {path} within {timeout_s} s")
            probe.abort(ProbeError("timed out"))
    return results


# --- /metrics, read fast -------------------------------------------------------------

_FIELDS = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # before vLLM 0.10
    "vllm:prefix_cache_queries": "prefix_queries",  # counters: samples end in _total
    "vllm:prefix_cache_hits": "prefix_hits",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:token_usage": "kv_usage",
}
_NAMES = [*_FIELDS, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
_SAMPLE = re.compile(
    rb"^("
    + b"|".join(re.escape(k.encode()) for k in sorted(_NAMES, key=len, reverse=True))
    # the name must end here: `vllm:prefix_cache_hits` is not `..._hits_created`
    + rb")(\{[^\n]*\})?[ \t]+([^ \t\n]+)",
    re.M,
)
_RANK = re.compile(rb"[{,][ \t]*" + RANK_LABEL.encode() + rb'="(\d+)"')
_BLOCK_SIZE = re.compile(rb'^vllm:cache_config_info\{[^\n]*?\bblock_size="(\d+)"', re.M)
_GPU_BLOCKS = re.compile(rb'^vllm:cache_config_info\{[^\n]*?\bnum_gpu_blocks="(\d+)"', re.M)


def parse_metrics_fast(text: bytes) -> EngineLoad:
    """`parse_engine_metrics` without the Prometheus parser: the same numbers (sum over
    label sets, the mean for KV usage, the block size and KV blocks from
    `vllm:cache_config_info`),
    read with one regular-expression scan of the page; `ValueError` for a value that is
    not a number (as the parser raises)."""
    load = EngineLoad()
    totals: dict[str, float] = {}  # per family, in the page's order (the last one wins)
    counts: dict[str, int] = {}
    by_rank: dict[str, dict[int, list[float]]] = {}
    for m in _SAMPLE.finditer(text):
        family = m.group(1).decode().removesuffix("_total")
        value = float(m.group(3))
        totals[family] = totals.get(family, 0.0) + value
        counts[family] = counts.get(family, 0) + 1
        labels = m.group(2)
        if labels and _FIELDS[family] in RANK_FIELDS:
            rank = _RANK.search(labels)
            if rank is not None:
                by_rank.setdefault(family, {}).setdefault(int(rank.group(1)), []).append(value)
    for family, total in totals.items():
        field = _FIELDS[family]
        setattr(load, field, total / counts[family] if field == "kv_usage" else total)
        if family in by_rank:
            set_rank_values(load, field, by_rank[family])
    bs = _BLOCK_SIZE.search(text)
    if bs is not None:
        load.block_size = int(bs.group(1))
    blocks = _GPU_BLOCKS.search(text)
    if blocks is not None and int(blocks.group(1)) > 0:
        load.num_gpu_blocks = int(blocks.group(1))
    return load
