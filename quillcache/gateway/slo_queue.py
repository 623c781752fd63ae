"""Queueing by priority instead of refusing (`slo_admission: queue`).

A request the admission stage refuses while waiting could still help (its TTFT miss
is queue time on the chosen engine, `SloMiss.waiting_helps`) waits here instead of
getting a 429. One pump retries the waiting requests every `tick_s`, in priority order
(lower first, vLLM's convention for `priority`; then arrival), each against what is
left of its SLO: a request that waited 300 ms of an 800 ms target is routed with a
500 ms target. One is admitted as soon as its estimate fits. It is refused (429) once
no wait can help any more: its SLO's remainder is below its own prefill, or it has
used up its SLO.

The waiting set is bounded (`max_waiting`): beyond it a request is refused at once,
as without the queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(order=True)
class _Waiter(Generic[T]):
    priority: int
    seq: int
    attempt: Callable[[], T | None] = field(compare=False)
    future: asyncio.Future[T] = field(compare=False)


class SloQueue(Generic[T]):
    """Waiting requests, retried in priority order until admitted or refused."""

    def __init__(self, max_waiting: int, tick_s: float = 0.01) -> None:
        self.max_waiting = max_waiting
        self.tick_s = tick_s
        self._heap: list[_Waiter[T]] = []
        self._seq = itertools.count()
        self._pump: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._heap)

    def full(self) -> bool:
        return len(self._heap) >= self.max_waiting

    async def wait(self, priority: int, attempt: Callable[[], T | None]) -> T:
        """Wait until `attempt()` returns a result (then it is this call's) or raises
        (then this call raises it). `attempt` returning None: not yet, try again."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._heap, _Waiter(priority, next(self._seq), attempt, future))
        if self._pump is None or self._pump.done():
            self._pump = asyncio.ensure_future(self._run())
        try:
            return await future
        finally:
            if not future.done():  # cancelled (the client left): no longer waiting
                future.cancel()

    async def _run(self) -> None:
        while self._heap:
            await asyncio.sleep(self.tick_s)
            self.step()

    def step(self) -> None:
        """One round: every waiter, in priority order, tries once. An admitted one leaves
        the queue, and so does a refused or cancelled one."""
        waiting = sorted(self._heap)
        self._heap = []
        for w in waiting:
            if w.future.done():
                continue
            try:
                result = w.attempt()
            except Exception as exc:  # the final refusal (or any error): the waiter's
                w.future.set_exception(exc)
                continue
            if result is None:
                self._heap.append(w)
            else:
                w.future.set_result(result)
        heapq.heapify(self._heap)
