"""The retries of configured engines that have not joined (`quillcache.gateway.pending`)."""

from __future__ import annotations

import asyncio
import time

from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.pending import FIRST_RETRY_S, PendingEngine, PendingEngines
from quillcache.gateway.workers import DiscoveryError, Worker


def pending(n: int) -> PendingEngines:
    engines = PendingEngines(retry_max_s=4.0)
    for i in range(n):
        engines.add(i, WorkerConfig(url=f"http://10.0.0.{i}:8000"), "down at start")
        engines.engines[i].next_try_s = 0.0  # due now
    return engines


def test_retries_run_at_most_at_once_together() -> None:
    engines = pending(10)
    running, most = 0, 0

    async def join(p: PendingEngine) -> Worker | None:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.01)
        running -= 1
        raise DiscoveryError(f"engine {p.config.url}: still down")

    asyncio.run(engines.retry_due(join, at_once=4))
    assert most == 4
    assert all(p.attempts == 2 and p.why.endswith("still down") for p in engines.engines.values())


def test_the_wait_doubles_up_to_its_limit() -> None:
    engines = pending(1)
    p = engines.engines[0]

    async def join(p: PendingEngine) -> Worker | None:
        raise DiscoveryError("down")

    waits = []
    for _ in range(5):
        p.next_try_s = 0.0
        before = time.monotonic()
        asyncio.run(engines.retry_due(join))
        waits.append(round(p.next_try_s - before))
    assert waits == [2 * FIRST_RETRY_S, 4, 4, 4, 4]  # 1 s after start, then 2, 4 (the limit)


def test_a_joined_engine_leaves_and_one_no_longer_wanted_too() -> None:
    engines = pending(3)
    joined = Worker(id=0, config=engines.engines[0].config)

    async def join(p: PendingEngine) -> Worker | None:
        if p.worker_id == 2:
            raise DiscoveryError("down")
        return joined if p.worker_id == 0 else None

    asyncio.run(engines.retry_due(join))
    assert list(engines.engines) == [2]
    assert engines.joined == 1


def test_an_engine_not_due_is_not_tried() -> None:
    engines = pending(2)
    engines.engines[1].next_try_s = time.monotonic() + 60
    tried = []

    async def join(p: PendingEngine) -> Worker | None:
        tried.append(p.worker_id)
        return None

    asyncio.run(engines.retry_due(join))
    assert tried == [0] and list(engines.engines) == [1]
