"""The gateway's client of LMCache's controller (`quillcache.gateway.lmcache_ctl`) over
real sockets: against the engine simulator's controller (LMCache 0.5.6's API), and
against servers that do not answer or answer garbage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from pydantic import ValidationError

from quillcache.gateway.lmcache_ctl import (
    CPU_LOCATION,
    LmcacheController,
    LmcacheError,
    LmcacheSettings,
)
from quillcache.up import Proc, engine_args, launch
from tests.online.helpers import free_port


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    extra = ["--engines", "2", "--lmcache", "vllm", "--lmcache-controller"]
    proc = launch("engines", engine_args(extra=extra), Path(tmp_path_factory.mktemp("lm")))
    try:
        yield proc
    finally:
        proc.kill()


def run(url: str, call: Callable[[LmcacheController], Awaitable[object]], **kw: float) -> object:
    async def go() -> object:
        async with aiohttp.ClientSession() as session:
            return await call(LmcacheController(session, LmcacheSettings(controller=url, **kw)))

    return asyncio.run(go())


@asynccontextmanager
async def server(reply: bytes | None) -> AsyncIterator[str]:
    """A TCP server on 127.0.0.1 that reads a request and answers `reply` (None: never)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        if reply is None:
            await asyncio.sleep(30)
        else:
            writer.write(reply)
            await writer.drain()
        writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with srv:
        yield f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


def test_the_simulators_controller_through_the_client(sim: Proc) -> None:
    url = sim.ready["lmcache_controller"]
    prompt = list(b"x" * 600)
    engine = sim.ready["engines"][0]["url"]

    async def go(c: LmcacheController) -> object:
        async with (
            aiohttp.ClientSession() as session,
            session.post(  # the engine stores the prompt in its LMCache
                engine + "/v1/completions",
                json={"model": "sim-model", "prompt": "x" * 600, "max_tokens": 1},
            ) as r,
        ):
            assert r.status == 200
        layout = await c.lookup(prompt)
        assert layout == {"lmcache-instance-0": (CPU_LOCATION, 600)}
        event, moved = await c.move(
            ("lmcache-instance-0", CPU_LOCATION),
            ("lmcache-instance-1", CPU_LOCATION),
            prompt,
            copy=True,
        )
        assert event.startswith("Move") and moved == 600
        assert await c.check_finish(event) is None  # 0.5.6: not implemented, an empty 500
        with pytest.raises(LmcacheError) as refused:
            await c.clear("nope", CPU_LOCATION)
        assert refused.value.status == 500
        assert "should be the same across all workers" in refused.value.detail
        _, cleared = await c.clear("lmcache-instance-1", CPU_LOCATION)
        assert cleared == 600
        assert c.calls[("move", "ok")] == 1 and c.calls[("clear", "error")] == 1
        return None

    run(url, go)


def test_a_controller_that_does_not_answer_times_out() -> None:
    async def go() -> None:
        async with server(None) as url, aiohttp.ClientSession() as session:
            c = LmcacheController(session, LmcacheSettings(controller=url, timeout_s=0.3))
            with pytest.raises(LmcacheError) as exc:
                await c.lookup([1, 2, 3])
            assert exc.value.status == 0 and "no answer in 0.3 s" in exc.value.detail
            assert c.calls[("lookup", "timeout")] == 1

    asyncio.run(go())


def test_no_controller_and_garbage_answers_are_typed_errors() -> None:
    with pytest.raises(LmcacheError) as gone:
        run(f"http://127.0.0.1:{free_port()}", lambda c: c.clear("i", CPU_LOCATION))
    assert gone.value.status == 0 and gone.value.call == "clear"

    async def garbage(reply: bytes, call: str) -> LmcacheError:
        async with server(reply) as url, aiohttp.ClientSession() as session:
            c = LmcacheController(session, LmcacheSettings(controller=url))
            with pytest.raises(LmcacheError) as exc:
                if call == "lookup":
                    await c.lookup([1])
                else:
                    await c.move(("a", CPU_LOCATION), ("b", CPU_LOCATION), [1], copy=True)
            return exc.value

    def http(status: str, body: bytes) -> bytes:
        head = f"HTTP/1.1 {status}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
        return head.encode() + body

    not_json = asyncio.run(garbage(http("502 Bad Gateway", b"<html>proxy</html>"), "lookup"))
    assert not_json.status == 502 and "proxy" in not_json.detail
    no_layout = asyncio.run(garbage(http("200 OK", b'{"event_id": "x"}'), "lookup"))
    assert no_layout.status == 200 and "layout_info" in no_layout.detail
    negative = asyncio.run(garbage(http("200 OK", b'{"event_id": "x", "num_tokens": -1}'), "move"))
    assert "num_tokens" in negative.detail


def test_settings_name_what_is_wrong() -> None:
    with pytest.raises(ValidationError, match="controller must start with http"):
        LmcacheSettings(controller="lmcache:9000")
    with pytest.raises(ValidationError, match="timeout_s"):
        LmcacheSettings(controller="http://c", timeout_s=0)
    with pytest.raises(ValidationError, match="extra"):
        LmcacheSettings.model_validate({"controller": "http://c", "instance": {}})
    s = LmcacheSettings(controller="http://c:9000/", instances={"http://e:8000/": "i0"})
    assert s.controller == "http://c:9000" and s.instances == {"http://e:8000": "i0"}
