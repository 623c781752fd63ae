"""A fleet for the multi-replica tests: a real Redis, engine simulators and gateway
replicas sharing it (the `fleet` fixture in conftest.py)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import httpx
import openai

from quillcache.state import LocalFallback, RedisFleetState, SharedLoad
from quillcache.up import Proc
from tests.online.conftest import ADMIN, Stack
from tests.state.server import RedisServer

LEASE_TTL_S = 1.0


def client(url: str, timeout: float = 30.0) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=timeout)


def prompt(tag: str, blocks: int = 8) -> str:
    """`blocks` full 16-token blocks (one token per byte, builtin tokenizer)."""
    text = (f"[{tag}] " + "a context shared by the fleet " * 40)[: blocks * 16]
    assert len(text.encode()) == blocks * 16
    return text


class Fleet:
    """A Redis, engines and replicas; every process killed at teardown."""

    def __init__(self, tmp: Path, relay: str = "native") -> None:
        self.tmp = tmp
        self.redis = RedisServer("redis-server", tmp).start()
        self.stack = Stack(tmp, relay)
        self.prefix = f"t{uuid.uuid4().hex[:8]}"
        self.replicas: list[Proc] = []

    def config(self, **extra: object) -> dict[str, object]:
        return {
            "state": self.redis.url,
            "state_prefix": self.prefix,
            "state_lease_ttl_s": LEASE_TTL_S,
            "state_poll_s": 0.1,
            # a loaded test host: Redis's round trips must not fall back for slowness
            "state_budget_s": 0.25,
            **extra,
        }

    def replica(self, **extra: object) -> Proc:
        proc = self.stack.start_gateway(self.config(**extra))
        self.replicas.append(proc)
        return proc

    def admin(self, proc: Proc) -> httpx.Client:
        return httpx.Client(
            base_url=proc.url, timeout=10.0, headers={"authorization": f"Bearer {ADMIN}"}
        )

    def urls_by_id(self, proc: Proc) -> dict[str, str]:
        with self.admin(proc) as a:
            return {str(w["id"]): w["url"] for w in a.get("/admin/workers").json()["workers"]}

    def loads(self) -> dict[str, SharedLoad]:
        """The fleet's booked load in Redis, by engine key."""

        async def read() -> dict[str, SharedLoad]:
            s = RedisFleetState(self.redis.url, prefix=self.prefix, budget_s=1.0)
            await s.start(background=False)
            try:
                out = await s.loads()
                assert not isinstance(out, LocalFallback), out
                return {k.encode(): v for k, v in out.items()}
            finally:
                await s.close(leave=True)

        return asyncio.run(read())

    def in_flight(self) -> int:
        return sum(v.in_flight for v in self.loads().values())

    def close(self) -> None:
        self.stack.kill_all()
        self.redis.stop()
