"""Run a coroutine from a callback now, and resume it as soon as a Redis reply comes.

`asyncio.ensure_future` runs a coroutine's first step on the loop's next turn, behind
whatever else is ready then, and a task waiting on a future resumes a turn after the
future is done. On the relay's shared-state path the first step routes the request and
writes its booking to Redis, and the step after the reply forwards it: each turn is a
wait behind the other requests the loop decides meanwhile. `start` runs the first step
in the caller (what Python 3.12's eager tasks do), and resumes the coroutine inside the
connection's read callback when it waits on a `resp.Reply` (`Reply.on_reply`); on any
other future, a turn later as a task would.

The coroutine does not run in a task: `asyncio.current_task()` is not its own, so it
must not use `asyncio.timeout` (or anything else that needs the current task) itself;
`asyncio.wait_for` and waiting on futures, events and locks work. Cancelling the
returned future cancels the future the coroutine waits on, which raises
`CancelledError` where it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Generic, TypeVar

from quillcache.state.resp import Reply

T = TypeVar("T")


class EagerError(RuntimeError):
    """The coroutine waited on something that is not an asyncio future of its loop."""


def start(coro: Coroutine[Any, Any, T]) -> asyncio.Future[T]:
    """Run `coro` up to its first wait now; the returned future has its result or its
    exception (one raised before the first wait too, as a task would hold it)."""
    loop = asyncio.get_running_loop()
    result: asyncio.Future[T] = loop.create_future()
    driver = _Driver(coro, result, loop)
    result.add_done_callback(driver.cancelled)
    driver.step()
    return result


class _Driver(Generic[T]):
    __slots__ = ("coro", "loop", "result", "waiting")

    def __init__(
        self,
        coro: Coroutine[Any, Any, T],
        result: asyncio.Future[T],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self.coro = coro
        self.result = result
        self.loop = loop
        self.waiting: asyncio.Future[Any] | None = None

    def step(self) -> None:
        self.waiting = None
        try:
            pending = self.coro.send(None)
        except StopIteration as stop:
            if not self.result.done():
                self.result.set_result(stop.value)
            return
        except BaseException as exc:  # the coroutine's outcome, whatever it is
            if not self.result.done():
                self.result.set_exception(exc)
            return
        if pending is None:  # a bare yield (`asyncio.sleep(0)`): again next turn
            self.loop.call_soon(self._step_if, None)
            return
        if not isinstance(pending, asyncio.Future) or pending.get_loop() is not self.loop:
            self.coro.close()
            if not self.result.done():
                self.result.set_exception(
                    EagerError(f"an eagerly run coroutine waited on {pending!r}")
                )
            return
        self.waiting = pending
        if isinstance(pending, Reply):
            pending.on_reply = self._replied
        # whichever comes first: the reply's hook, or the future done another way (a
        # timeout, a lost connection, a cancellation, any other future)
        pending.add_done_callback(self._step_if)
        if self.result.cancelled():
            pending.cancel()

    def _replied(self) -> None:
        if self.waiting is not None and self.waiting.done():
            self.step()

    def _step_if(self, fut: asyncio.Future[Any] | None) -> None:
        if fut is self.waiting:
            self.step()

    def cancelled(self, result: asyncio.Future[T]) -> None:
        waiting = self.waiting
        if result.cancelled() and waiting is not None:
            waiting.cancel()
            self.step()  # CancelledError where it waits, now
