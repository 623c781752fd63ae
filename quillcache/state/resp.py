"""One pipelined Redis connection for the calls on a routed request's path.

redis-py's asyncio client costs about 55-80 us of CPU per command on the project's
machine (its connection pool, its command packing and reading, a lock per
connection), more than the whole booking script takes in Redis. This connection packs
with hiredis's `pack_command` and parses with hiredis's `Reader` on a plain asyncio
protocol: 13 us of CPU for a PING, 34 us for a booking (results/state.md). It carries
the scripts that change this replica's share (book, prefill-done, release, renew,
resync, leave); everything else goes through the redis client.

Commands are pipelined: each call writes at once and waits for its own reply, in the
order Redis answers them (one connection: Redis runs them in the order sent, which also
orders a resync after every booking sent before it). A call abandoned by its caller
(a timeout) keeps its place in the queue and its reply is dropped on arrival: no
reconnect, unlike redis-py, which must drop a connection whose reply it will not read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis.asyncio.connection import parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from quillcache.errors import ConfigError


class Reply(asyncio.Future[Any]):
    """A call's reply. `on_reply`: run as soon as the reply is read, in the connection's
    read callback, before anything else the loop has ready (a waiting coroutine that a
    done callback would resume only on the loop's next turn; `gateway.eager`)."""

    def __init__(self, *, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop=loop)
        self.on_reply: Callable[[], None] | None = None


class RespConnection(asyncio.Protocol):
    def __init__(self) -> None:
        self._reader = hiredis.Reader(replyError=ResponseError, encoding="utf-8")
        self._waiters: deque[Reply] = deque()
        self._transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None

    @classmethod
    async def open(cls, url: str) -> RespConnection:
        """Connect to a `redis://` or `unix://` URL (with its user, password and db);
        `rediss://` (TLS) is not handled here: ConfigError."""
        if url.startswith("rediss://"):
            raise ConfigError("the fast connection does not do TLS; use fast_path=False")
        kw = parse_url(url)
        loop = asyncio.get_running_loop()
        proto: RespConnection
        if "path" in kw:
            _, proto = await loop.create_unix_connection(cls, kw["path"])
        else:
            _, proto = await loop.create_connection(
                cls, kw.get("host", "localhost"), int(kw.get("port", 6379))
            )
        try:
            if kw.get("password"):
                user = [kw["username"]] if kw.get("username") else []
                await proto.call("AUTH", *user, kw["password"])
            if int(kw.get("db", 0) or 0):
                await proto.call("SELECT", int(kw["db"]))
        except BaseException:
            proto.close()
            raise
        return proto

    # --- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(RedisConnectionError(f"protocol error from redis: {exc}"))
                self.close()
                return
            if reply is False:
                return
            if not self._waiters:  # a reply nobody asked for: the stream is not ours
                self._fail(RedisConnectionError("unexpected reply from redis"))
                self.close()
                return
            fut = self._waiters.popleft()
            if fut.done():  # its caller gave up (timeout): drop the reply
                continue
            if isinstance(reply, ResponseError):
                err = NoScriptError(str(reply)) if str(reply).startswith("NOSCRIPT") else reply
                fut.set_exception(err)
            else:
                fut.set_result(reply)
            hook = fut.on_reply
            if hook is not None:
                fut.on_reply = None
                hook()  # (its own errors are its own: `eager` catches everything)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"connection to redis lost: {exc or 'closed'}"))

    # --- calls -----------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        return (
            self.lost is None and self._transport is not None and not self._transport.is_closing()
        )

    def call(self, *args: str | int | float) -> Reply:
        """Send one command now; the future is its reply (a ResponseError raised for an
        error reply, RedisConnectionError when the connection goes first)."""
        if not self.usable:
            raise RedisConnectionError(f"connection to redis lost: {self.lost or 'closed'}")
        assert self._transport is not None
        fut = Reply(loop=asyncio.get_running_loop())
        # (hiredis's stub types the argument as a 1-tuple)
        self._transport.write(hiredis.pack_command(args))  # type: ignore[arg-type]
        self._waiters.append(fut)
        return fut

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _fail(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(exc)
