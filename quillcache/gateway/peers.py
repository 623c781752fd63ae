"""Replicas of one fleet find each other's snapshot endpoint through Redis.

A ready replica advertises the base URL of its admin API under the fleet's prefix, in
one sorted set, `{<prefix>}:peers` (member: the URL, score: a lease deadline in ms on
Redis's clock, as the fleet's load leases are), renewed every TTL / 3 while it is ready
and withdrawn when it is not or when it stops; a joining replica lists the members whose
lease has not lapsed, freshest first, and asks them for a snapshot in that order. A
replica killed without withdrawing drops out when its lease lapses (the listing and every
renewal remove lapsed members). Only ready replicas are listed: a replica that has not
caught up has an incomplete image and refuses to serve it anyway.

This module has its own small client: the booking path's client (`quillcache/state`) is
tuned for one round trip per request, this is a few calls per replica lifetime.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

_ADVERTISE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
return 1
"""

_LIST = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZREVRANGEBYSCORE', KEYS[1], '+inf', '(' .. now)
"""

_LOG_EVERY_S = 10.0


def peers_key(prefix: str) -> str:
    """In the fleet's hash slot, next to its other keys (docs/state.md)."""
    return f"{{{prefix}}}:peers"


class PeerDirectory:
    def __init__(self, url: str, prefix: str, lease_ttl_s: float, timeout_s: float = 2.0) -> None:
        self.key = peers_key(prefix)
        self.lease_ms = max(1, int(lease_ttl_s * 1000))
        self.lease_ttl_s = lease_ttl_s
        self.client: Any = aioredis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._advertise = self.client.register_script(_ADVERTISE)
        self._list = self.client.register_script(_LIST)
        self._task: asyncio.Task[None] | None = None
        self._advertised: str | None = None
        self._last_log = 0.0

    async def peers(self, exclude: str | None = None) -> list[str]:
        """Ready replicas' URLs whose lease has not lapsed, freshest first."""
        raw = await self._list(keys=[self.key])
        urls = [u.decode() if isinstance(u, bytes) else str(u) for u in raw]
        return [u for u in urls if u != exclude]

    async def advertise(self, url: str) -> None:
        await self._advertise(keys=[self.key], args=[url, self.lease_ms])
        self._advertised = url

    async def withdraw(self) -> None:
        if self._advertised is not None:
            await self.client.zrem(self.key, self._advertised)
            self._advertised = None

    def start(self, url: str, ready: Callable[[], bool]) -> None:
        """Advertise `url` every TTL / 3 while `ready()`, withdraw it while not."""
        self._task = asyncio.create_task(self._run(url, ready))

    async def _run(self, url: str, ready: Callable[[], bool]) -> None:
        while True:
            try:
                if ready():
                    await self.advertise(url)
                else:
                    await self.withdraw()
            except (RedisError, OSError) as exc:
                now = time.monotonic()
                if now - self._last_log >= _LOG_EVERY_S:
                    self._last_log = now
                    log.warning("peers: cannot advertise %s in Redis: %s", url, exc)
            await asyncio.sleep(self.lease_ttl_s / 3)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            await self.withdraw()
        with contextlib.suppress(Exception):
            await self.client.aclose()
