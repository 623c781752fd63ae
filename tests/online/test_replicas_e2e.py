"""Several gateway replicas sharing their state through a real `redis-server` (issue 16
§1/§2): engine simulators and gateways as processes, the official `openai` client."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from quillcache.state import LocalFallback, RedisFleetState, SharedLoad
from quillcache.up import Proc
from tests.online.conftest import ADMIN, Stack, metric
from tests.online.helpers import http_get, wait_for
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

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.redis = RedisServer("redis-server", tmp).start()
        self.stack = Stack(tmp)
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


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path)
    try:
        yield f
    finally:
        f.close()


def scrape(proc: Proc, name: str) -> float:
    return metric(http_get(proc.url + "/metrics").text, name)


def test_replicas_route_a_workload_end_to_end(fleet: Fleet) -> None:
    for _ in range(3):
        fleet.stack.engine()
    replicas = [fleet.replica(router="quillcache") for _ in range(3)]
    clients = [client(r.url) for r in replicas]

    def one(i: int) -> str:
        oa = clients[i % len(clients)]
        tag = f"user{i % 6}"  # six prefixes, each reused through every replica
        out = oa.completions.create(model="sim-model", prompt=prompt(tag), max_tokens=4)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(60)))
    assert all(answers)
    shared = [
        metric(
            http_get(r.url + "/metrics").text, 'quillcache_state_bookings_total{outcome="shared"}'
        )
        for r in replicas
    ]
    assert sum(shared) == 60, shared
    assert all(n > 0 for n in shared)
    assert (
        sum(scrape(r, 'quillcache_state_bookings_total{outcome="fallback"}') for r in replicas) == 0
    )
    # every booking released: nothing left in flight in Redis
    wait_for(lambda: fleet.in_flight() == 0, 5.0, "the fleet's load back to zero")
