"""The SLO queue (quillcache/gateway/slo_queue.py): waiters are admitted in priority
order (lower first, then arrival), a refusal reaches its waiter, a cancelled waiter
leaves, against a reference order."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.gateway.slo_queue import SloQueue


@settings(max_examples=50, deadline=None)
@given(
    priorities=st.lists(st.integers(-3, 3), min_size=1, max_size=12),
    per_round=st.integers(1, 3),
)
def test_admitted_in_priority_then_arrival_order(priorities: list[int], per_round: int) -> None:
    async def run() -> list[int]:
        queue: SloQueue[int] = SloQueue(max_waiting=100, tick_s=0.001)
        admitted: list[int] = []
        budget = [0]

        def attempt_for(i: int) -> Callable[[], int | None]:
            def attempt() -> int | None:
                if budget[0] <= 0:
                    return None
                budget[0] -= 1
                admitted.append(i)
                return i

            return attempt

        tasks = [
            asyncio.ensure_future(queue.wait(p, attempt_for(i))) for i, p in enumerate(priorities)
        ]
        await asyncio.sleep(0)  # every waiter enqueued before any round
        while len(admitted) < len(priorities):
            budget[0] = per_round
            queue.step()
            await asyncio.sleep(0)
        assert [await t for t in tasks] == list(range(len(priorities)))
        return admitted

    order = asyncio.run(run())
    assert order == sorted(range(len(priorities)), key=lambda i: (priorities[i], i))


def test_a_refusal_reaches_its_waiter_and_a_cancelled_waiter_leaves() -> None:
    async def run() -> None:
        queue: SloQueue[int] = SloQueue(max_waiting=2, tick_s=0.001)

        def refuse() -> int | None:
            raise LookupError("no wait helps")

        refused = asyncio.ensure_future(queue.wait(0, refuse))
        pending = asyncio.ensure_future(queue.wait(0, lambda: None))
        await asyncio.sleep(0)
        assert len(queue) == 2 and queue.full()
        try:
            await refused
        except LookupError:
            pass
        else:
            raise AssertionError("the refusal did not reach its waiter")
        pending.cancel()
        await asyncio.sleep(0.01)
        assert len(queue) == 0

    asyncio.run(run())
