"""The pipelined connection of the share-changing scripts (quillcache/state/resp.py)."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from quillcache.errors import ConfigError
from quillcache.state.resp import RespConnection
from tests.state.helpers import run
from tests.state.server import RedisServer


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_pipelined_replies_errors_and_abandoned_calls(redis_server: RedisServer, loop: str) -> None:
    async def main() -> None:
        c = await RespConnection.open(redis_server.url)
        try:
            # many calls in flight at once: each gets its own reply, in order
            futs = [c.call("INCR", "n") for _ in range(200)]
            assert await asyncio.gather(*futs) == list(range(1, 201))
            assert await c.call("HSET", "h", "f", "v") == 1
            assert await c.call("HGETALL", "h") == ["f", "v"]
            with pytest.raises(ResponseError):
                await c.call("INCR", "h")  # WRONGTYPE
            with pytest.raises(NoScriptError):
                await c.call("EVALSHA", "0" * 40, 0)
            # a call abandoned while Redis does not answer: its reply is dropped when it
            # comes, and the next call gets its own
            redis_server.pause()
            try:
                with pytest.raises(TimeoutError):
                    async with asyncio.timeout(0.05):
                        await c.call("SET", "k", "first")
            finally:
                redis_server.resume()
            assert await c.call("GET", "k") == "first"
            assert c.usable
            # the server goes: calls in flight fail, and the connection says so
            pending = c.call("BLPOP", "nothing", 5)
            redis_server.stop()
            with pytest.raises(RedisConnectionError):
                await pending
            assert not c.usable
            with pytest.raises(RedisConnectionError):
                c.call("PING")
        finally:
            c.close()

    run(main(), loop=loop)


def test_db_and_tls_urls(redis_server: RedisServer) -> None:
    async def main() -> None:
        c = await RespConnection.open(redis_server.url.replace("/0", "/3"))
        await c.call("SET", "where", "db3")
        c.close()
        d = await RespConnection.open(redis_server.url)
        assert await d.call("GET", "where") is None
        assert await d.call("SELECT", 3) == "OK"
        assert await d.call("GET", "where") == "db3"
        d.close()
        with pytest.raises(ConfigError):
            await RespConnection.open("rediss://127.0.0.1:1/0")

    run(main())
