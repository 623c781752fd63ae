"""`gateway.eager.start`: the first step runs in the caller, the rest as a task, with
the result, the exceptions and a cancellation where a task would have them."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import pytest

from quillcache.gateway import eager
from quillcache.gateway.slo_queue import SloQueue
from quillcache.state.resp import RespConnection
from tests.state.helpers import run
from tests.state.server import RedisServer

LOOPS = pytest.mark.parametrize("loop", ["asyncio", "uvloop"])


@LOOPS
def test_the_first_step_runs_before_start_returns(loop: str) -> None:
    async def main() -> None:
        steps: list[str] = []
        gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def work() -> int:
            steps.append("first")
            got = await gate
            steps.append("second")
            return got + 1

        fut = eager.start(work())
        assert steps == ["first"]  # ensure_future would not have run it yet
        gate.set_result(41)
        assert await fut == 42
        assert steps == ["first", "second"]

    run(main(), loop=loop)


@LOOPS
def test_a_coroutine_that_never_waits_is_done_at_once(loop: str) -> None:
    async def main() -> None:
        async def now() -> str:
            return "done"

        fut = eager.start(now())
        assert fut.done() and fut.result() == "done"

    run(main(), loop=loop)


@LOOPS
def test_an_exception_before_or_after_the_wait_is_the_futures(loop: str) -> None:
    async def main() -> None:
        async def early() -> None:
            raise ValueError("early")

        with pytest.raises(ValueError, match="early"):
            await eager.start(early())

        async def late() -> None:
            await asyncio.sleep(0)
            await asyncio.sleep(0.001)
            raise KeyError("late")

        with pytest.raises(KeyError, match="late"):
            await eager.start(late())

    run(main(), loop=loop)


@LOOPS
def test_cancelling_reaches_the_coroutine_where_it_waits(loop: str) -> None:
    async def main() -> None:
        cleaned: list[str] = []
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def work() -> None:
            try:
                await gate
            finally:
                cleaned.append("finally")

        fut = eager.start(work())
        await asyncio.sleep(0)
        fut.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fut
        await asyncio.sleep(0)  # (a task's cancellation also lands a turn later)
        assert cleaned == ["finally"]
        assert gate.cancelled()

    run(main(), loop=loop)


@LOOPS
def test_a_redis_reply_resumes_the_coroutine_in_the_read_callback(
    redis_server: RedisServer, loop: str
) -> None:
    """Resumed when the reply is read, before the loop's next turn: before any done
    callback of the reply (a task would resume after the ones added before it)."""

    async def main() -> None:
        lane = await RespConnection.open(redis_server.url)
        order: list[str] = []

        async def book() -> str:
            reply = lane.call("PING")
            reply.add_done_callback(lambda _: order.append("callback"))
            got = await reply
            order.append("resumed")
            return str(got)

        try:
            assert await eager.start(book()) == "PONG"
            assert order == ["resumed", "callback"]
            order.clear()
            assert await asyncio.ensure_future(book()) == "PONG"
            assert order == ["callback", "resumed"]  # what a task does
        finally:
            lane.close()

    run(main(), loop=loop)


@LOOPS
def test_a_timed_out_reply_resumes_the_coroutine_with_the_timeout(
    redis_server: RedisServer, loop: str
) -> None:
    async def main() -> None:
        lane = await RespConnection.open(redis_server.url)

        async def book() -> str:
            reply = lane.call("PING")
            asyncio.get_running_loop().call_later(0.01, _expire, reply)
            return str(await reply)

        redis_server.pause()
        try:
            with pytest.raises(TimeoutError):
                await eager.start(book())
        finally:
            redis_server.resume()
        assert await lane.call("PING") == "PONG"  # the late reply was dropped
        lane.close()

    run(main(), loop=loop)


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


@LOOPS
def test_what_it_waits_on_must_be_a_future(loop: str) -> None:
    class Odd:
        def __await__(self) -> Generator[Any, None, None]:
            yield "not a future"

    async def main() -> None:
        async def odd() -> None:
            await Odd()

        with pytest.raises(eager.EagerError):
            await eager.start(odd())

    run(main(), loop=loop)


@LOOPS
def test_an_slo_queue_wait_runs_eagerly(loop: str) -> None:
    """What the relay's SLO-queue path would run through `eager.start`: a request
    admitted at once is decided before `start` returns; one that waits in the queue is
    resumed by the pump; a cancelled one leaves the queue."""

    async def main() -> None:
        queue: SloQueue[str] = SloQueue(max_waiting=4, tick_s=0.001)
        tries = {"now": 0, "later": 0, "gone": 0}

        def attempt(name: str, ready_after: int) -> Callable[[], str | None]:
            def once() -> str | None:
                tries[name] += 1
                return name if tries[name] > ready_after else None

            return once

        async def admitted(name: str, ready_after: int) -> str:
            first = attempt(name, ready_after)()
            if first is not None:  # what `admitted` does before it queues
                return first
            return await queue.wait(0, attempt(name, ready_after))

        now = eager.start(admitted("now", 0))
        assert now.done() and now.result() == "now"
        later = eager.start(admitted("later", 3))
        gone = eager.start(admitted("gone", 1000))
        assert not later.done() and len(queue) == 2
        assert await asyncio.wait_for(later, 5) == "later"
        gone.cancel()
        for _ in range(100):
            if not len(queue):
                break
            await asyncio.sleep(0.002)
        assert len(queue) == 0 and gone.cancelled()

    run(main(), loop=loop)
