"""Configured engines the gateway could not take in yet, retried until it can.

A gateway of a fleet starts beside its engines, not after them: an orchestrator starts
both at once, a vLLM server takes minutes to load its model, one engine of hundreds is
always restarting. A configured engine that cannot be described (`/v1/models`
unreachable) or whose KV-event socket cannot be opened yet (a port still held) is
therefore not a reason to refuse to start: it is *pending*. It keeps the worker id of its
place in the configuration (ids stay the same whatever order engines come up in), is
retried with a growing wait (1 s doubling up to `retry_max_s`), and joins the pool like
an engine added through the admin API once it answers. `/admin/workers` and `/ready`
list pending engines with the reason, `quillcache_workers_pending` counts them, and the
log says when one is first missed, when its reason changes and when it joins.

What cannot be retried away is refused at start: every engine pending and no
`block_size` configured leaves the gateway without the block size it hashes with.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from quillcache.errors import ConfigError
from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.workers import Worker

log = logging.getLogger(__name__)

FIRST_RETRY_S = 1.0


@dataclass
class PendingEngine:
    worker_id: int  # reserved: its place in the configuration
    config: WorkerConfig
    why: str
    attempts: int = 1
    next_try_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.worker_id,
            "url": self.config.url,
            "why": self.why,
            "attempts": self.attempts,
        }


class PendingEngines:
    """The engines waiting to join, and the retry of each (`retry_due`)."""

    def __init__(self, retry_max_s: float = 30.0) -> None:
        self.retry_max_s = retry_max_s
        self.engines: dict[int, PendingEngine] = {}
        self.joined = 0  # engines that were pending and joined

    def add(self, worker_id: int, config: WorkerConfig, why: str) -> None:
        self.engines[worker_id] = PendingEngine(
            worker_id, config, why, next_try_s=time.monotonic() + FIRST_RETRY_S
        )
        log.warning(
            "engine %s (worker %d) is not available yet: %s; the gateway starts without it "
            "and retries until it joins",
            config.url,
            worker_id,
            why,
        )

    def remove(self, worker_id: int) -> PendingEngine | None:
        return self.engines.pop(worker_id, None)

    def as_list(self) -> list[dict[str, Any]]:
        return [p.as_dict() for p in self.engines.values()]

    async def retry_due(
        self, join: Callable[[PendingEngine], Awaitable[Worker | None]], at_once: int = 64
    ) -> None:
        """Try each engine whose wait is over, `at_once` at a time (a whole fleet may be
        pending, some of it behind connect timeouts): `join` describes and attaches it,
        raising a `ConfigError` while it cannot (unreachable, its KV port held, another
        block size), None when it is no longer to join (it then leaves the list)."""
        now = time.monotonic()
        due = [p for p in self.engines.values() if p.next_try_s <= now]
        if not due:
            return
        gate = asyncio.Semaphore(at_once)

        async def one(p: PendingEngine) -> None:
            async with gate:
                try:
                    w = await join(p)
                except ConfigError as exc:  # DiscoveryError, EventSourceError, a block size
                    self._missed(p, str(exc))
                    return
            if self.engines.get(p.worker_id) is p:
                del self.engines[p.worker_id]
            if w is not None:
                self.joined += 1
                log.info("engine %s joined as worker %d after %d attempts", w.url, w.id, p.attempts)

        await asyncio.gather(*(one(p) for p in due))

    def _missed(self, p: PendingEngine, why: str) -> None:
        if why != p.why:
            log.warning("engine %s (worker %d) still pending: %s", p.config.url, p.worker_id, why)
        p.why = why
        p.attempts += 1
        wait = min(FIRST_RETRY_S * 2 ** (p.attempts - 1), self.retry_max_s)
        p.next_try_s = time.monotonic() + wait
