"""Helpers of the shared-state tests."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

from quillcache.state import Candidate, EngineKey, LocalFallback, RedisFleetState, SharedLoad

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout: float = 60.0, loop: str = "asyncio") -> T:
    """`loop`: "asyncio", or "uvloop" (what the gateway runs on)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(asyncio.wait_for(coro, timeout))
    return asyncio.run(asyncio.wait_for(coro, timeout))


def fleet() -> str:
    """A prefix of its own for each test (or hypothesis example)."""
    return f"test-{uuid.uuid4().hex[:10]}"


def shortlist(*ceilings: float) -> list[Candidate]:
    return [Candidate(EngineKey(i), c) for i, c in enumerate(ceilings)]


async def loads_of(state: RedisFleetState) -> dict[EngineKey, SharedLoad]:
    out = await state.loads()
    assert not isinstance(out, LocalFallback), out
    return out


def in_flight(loads: dict[EngineKey, SharedLoad]) -> dict[int, int]:
    return {k.engine: v.in_flight for k, v in sorted(loads.items()) if v.in_flight}
