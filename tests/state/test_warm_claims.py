"""Fleet-wide warm claims (`quillcache.state.warm_claims`) against real redis-server and
valkey-server, and two replicas' Warmers sending to a real engine simulator.

What must hold: of several claimers of one warm exactly one wins; only the owner
releases; a marker expires (a replica that died mid-warm frees it) and lingers after a
success; the engine and tenant buckets are taken both or neither, as the local
`ActuationBudget` takes them; two replicas spend the fleet's budget once and send a warm
once; with Redis down or paused a warm falls back to the replica's own budget at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.asyncio import Redis

from quillcache.gateway.actuator import Warmer
from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.workers import Worker
from quillcache.identity import content_keys, namespace
from quillcache.policy.budget import ActuationBudget
from quillcache.policy.hot import HotPrefixes, Owner
from quillcache.policy.retention import WarmAction
from quillcache.policy.targets import Target, TargetKind
from quillcache.state.warm_claims import ClaimResult, Rates, WarmClaim, WarmClaims
from tests.online.conftest import Stack, make_stack, metric
from tests.state.helpers import run
from tests.state.server import RedisServer

# no refill within a test: the buckets hold what their burst says
STILL = Rates(engine_rate=1e-9, engine_burst=1000.0, tenant_rate=1e-9, tenant_burst=1000.0)
PREFIX = "wctest"


def warm(
    key: int = 7, *, tokens: float = 10, ttl_s: float = 5.0, tenant: str = "acme"
) -> WarmClaim:
    return WarmClaim(
        "retain", engine=42, content_key=key, tenant=tenant, tokens=tokens, ttl_s=ttl_s
    )


def claims(server: RedisServer, **kw: object) -> WarmClaims:
    # a budget no loaded CI host misses: tests of the fallback pass their own
    kw.setdefault("timeout_s", 5.0)
    return WarmClaims(server.url, prefix=PREFIX, margin_s=0.0, **kw)  # type: ignore[arg-type]


def test_of_several_claimers_exactly_one_wins(redis_server: RedisServer) -> None:
    async def body() -> None:
        replicas = [claims(redis_server) for _ in range(5)]
        try:
            got = await asyncio.gather(*(r.claim(warm(), STILL) for r in replicas))
            assert sorted(g.value for g in got) == ["in_flight"] * 4 + ["ok"]
            # only the winner paid: the engine bucket holds burst minus one warm's tokens
            raw = Redis.from_url(redis_server.url, decode_responses=True)
            level = float(await raw.hget(replicas[0].buckets(warm())[0], "l") or "nan")
            assert level == pytest.approx(990.0)
            await raw.aclose()
            # another engine or another action is another marker
            other = WarmClaim("prefetch", 42, 7, "acme", 10, 5.0)
            assert await replicas[1].claim(other, STILL) is ClaimResult.OK
        finally:
            for r in replicas:
                await r.aclose()

    run(body())


def test_only_the_owner_releases(redis_server: RedisServer) -> None:
    async def body() -> None:
        a, b = claims(redis_server), claims(redis_server)
        try:
            assert await a.claim(warm(), STILL) is ClaimResult.OK
            assert await b.release(warm()) is False  # not b's: the marker stays a's
            assert await b.claim(warm(), STILL) is ClaimResult.IN_FLIGHT
            assert await a.release(warm()) is True
            assert await b.claim(warm(), STILL) is ClaimResult.OK
            assert await a.release(warm()) is False  # b's now
            assert b.stats.lost == 1 and a.stats.lost == 1
        finally:
            await a.aclose()
            await b.aclose()

    run(body())


def test_a_marker_expires_and_lingers_after_a_success(redis_server: RedisServer) -> None:
    async def body() -> None:
        a, b = claims(redis_server), claims(redis_server)
        try:
            # a replica that dies mid-warm never releases: the marker's TTL frees it
            assert await a.claim(warm(ttl_s=0.3), STILL) is ClaimResult.OK
            assert await b.claim(warm(), STILL) is ClaimResult.IN_FLIGHT
            await asyncio.sleep(0.45)
            assert await b.claim(warm(ttl_s=5.0), STILL) is ClaimResult.OK
            # a success lingers linger_s: "recently placed" for the whole fleet
            assert await b.release(warm(), linger_s=0.3) is True
            assert await a.claim(warm(), STILL) is ClaimResult.IN_FLIGHT
            await asyncio.sleep(0.45)
            assert await a.claim(warm(), STILL) is ClaimResult.OK
            # a failure releases at once
            assert await a.release(warm(), linger_s=0.0) is True
            assert await b.claim(warm(), STILL) is ClaimResult.OK
        finally:
            await a.aclose()
            await b.aclose()

    run(body())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(st.sampled_from([1, 2]), st.sampled_from(["t1", "t2", "t3"]), st.integers(1, 60)),
        min_size=1,
        max_size=25,
    ),
    st.integers(30, 200),
    st.integers(30, 200),
)
def test_buckets_are_taken_both_or_neither_like_the_local_budget(
    redis_server: RedisServer, ops: list[tuple[int, str, int]], engine_burst: int, tenant_burst: int
) -> None:
    rates = Rates(1e-9, float(engine_burst), 1e-9, float(tenant_burst))
    # the reference: the replica's own budget, with the same bursts and no refill
    local = ActuationBudget(engine_rate=1e-9, tenant_rate=1e-9, burst_s=1.0)
    local.engines.burst, local.tenants.burst = float(engine_burst), float(tenant_burst)

    async def run() -> None:
        raw = Redis.from_url(redis_server.url)
        await raw.flushdb()
        await raw.aclose()
        c = claims(redis_server)
        try:
            for i, (engine, tenant, tokens) in enumerate(ops):
                w = WarmClaim("prefetch", engine, i, tenant, tokens, 5.0)  # a marker each
                got = await c.claim(w, rates)
                want = local.take(engine, tenant, tokens, 0.0)
                assert got is (ClaimResult.OK if want else ClaimResult.BUDGET), (i, ops)
        finally:
            await c.aclose()

    asyncio.run(run())


def test_redis_down_or_slow_falls_back_at_once(redis_server: RedisServer) -> None:
    async def body() -> None:
        c = claims(redis_server, timeout_s=0.1, retry_s=0.3)
        try:
            assert await c.claim(warm(1), STILL) is ClaimResult.OK
            redis_server.pause()
            started = time.monotonic()
            assert await c.claim(warm(2), STILL) is ClaimResult.FLEET_DOWN
            assert await c.release(warm(1)) is None
            assert time.monotonic() - started < 1.0  # one timeout, then not tried for retry_s
            redis_server.resume()
            redis_server.stop()
            await asyncio.sleep(0.35)
            assert await c.claim(warm(3), STILL) is ClaimResult.FLEET_DOWN
            assert c.stats.fallbacks >= 3
            redis_server.start(same_port=True)  # back (empty): claims are the fleet's again
            await asyncio.sleep(0.35)
            assert await c.claim(warm(4), STILL) is ClaimResult.OK
        finally:
            await c.aclose()

    run(body())


# -- two replicas' Warmers, one Redis, one engine simulator ---------------------------


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


BLOCK = 16


def target(name: str, blocks: int = 4) -> Target:
    return Target(
        kind=TargetKind.PIN,
        tenant="acme",
        name=name,
        keys=np.arange(1, blocks + 1, dtype=np.uint64) + np.uint64(1000 * sum(map(ord, name))),
        token_ids=list(range(blocks * BLOCK)),
        model="sim-model",
        salt=None,
        expires_s=float("inf"),
    )


def replica(session: aiohttp.ClientSession, wc: WarmClaims | None, burst_tokens: float) -> Warmer:
    budget = ActuationBudget(engine_rate=1e-9, tenant_rate=1e-9, burst_s=1.0)
    budget.engines.burst = budget.tenants.burst = burst_tokens
    return Warmer(
        session, budget, block_size=BLOCK, timeout_s=5.0, max_concurrent=4, claims=wc, linger_s=0.5
    )


def served(url: str) -> float:
    return metric(httpx.get(url + "/metrics").text, "vllm:request_success_total")


def test_two_replicas_warm_once_and_spend_the_fleet_budget_once(
    redis_server: RedisServer, stack: Stack
) -> None:
    async def body() -> None:
        engine = stack.engine()
        worker = Worker(0, WorkerConfig(url=engine.url))
        async with aiohttp.ClientSession() as session:
            # 96 tokens a budget: one 64-token warm per replica locally, one in the fleet
            wcs = [claims(redis_server), claims(redis_server)]
            a, b = (replica(session, wc, 96) for wc in wcs)
            try:
                t = target("one")
                got = await asyncio.gather(
                    a.warm(worker, t, WarmAction.RETAIN, 0),
                    b.warm(worker, target("one"), WarmAction.RETAIN, 0),
                )
                assert sorted(got) == ["in_flight", "ok"]
                assert served(engine.url) == 1
                # the success lingers: neither replica retains it again within linger_s
                assert await a.warm(worker, target("one"), WarmAction.RETAIN, 0) == "in_flight"
                # another prefix: the fleet's budget is spent, whichever replica asks
                assert await b.warm(worker, target("two"), WarmAction.RETAIN, 0) == "budget"
                assert await a.warm(worker, target("two"), WarmAction.RETAIN, 0) == "budget"
                assert served(engine.url) == 1
                # Redis gone: each replica's own budget and markers, as without shared state
                redis_server.stop()
                assert await b.warm(worker, target("two"), WarmAction.RETAIN, 0) == "ok"
                assert served(engine.url) == 2
                assert wcs[1].stats.fallbacks >= 1
            finally:
                for wc in wcs:
                    await wc.aclose()

    run(body())


def test_replicas_share_their_heat_and_find_a_prefix_hot_only_the_fleet_sees(
    redis_server: RedisServer,
) -> None:
    """Two replicas behind a round-robin balancer each see half of a prefix's requests:
    alone, neither finds it hot (each sees half of `min_rate`); sharing their heat
    through Redis, both copy it at their share of the threshold and find it hot at the
    fleet's rate, the sum of theirs. A replica that stops publishing leaves the count
    and the sum within the TTL; Redis down, each falls back to its own rate."""
    bs, min_rate, rate = 4, 4.0, 6.0  # the fleet's requests a second: above, halves below
    ns = namespace("m", "tok", "", "", bs)
    tokens = list(range(8 * bs))
    keys = np.asarray(content_keys(tokens, bs, ns), dtype=np.uint64)
    owner = Owner("acme", None, "m")

    def fleet() -> list[HotPrefixes]:
        return [HotPrefixes(block_size=bs, min_rate=min_rate, half_life_s=2.0) for _ in range(2)]

    async def body() -> None:
        alone, shared = fleet(), fleet()
        heat = [claims(redis_server) for _ in range(2)]
        found: list[list[float]] = []
        try:
            now = 0.0
            for i in range(int(rate * 12)):  # 12 s of the fleet's requests, round robin
                now = i / rate
                for hp in (alone[i % 2], shared[i % 2]):
                    hp.observe(keys, tokens, owner, now)
                if i % 3 == 2:  # a policy tick on each replica
                    ticked = []
                    for hp, h in zip(shared, heat, strict=True):
                        copies = hp.hot(now)
                        got = await h.share_heat(
                            [(c.prefix.key, c.prefix.rate) for c in copies], 5.0
                        )
                        # the first replica's first call: the second has not yet published
                        assert got is not None and got.replicas == (
                            1 if not found and h is heat[0] else 2
                        )
                        ticked += [
                            c.prefix.rate
                            for c in hp.at_fleet_rates(copies, got.replicas, got.rates)
                        ]
                    found.append(ticked)
            # alone, each replica's own rate stays under min_rate: never hot
            assert all(hp.hot(now) == [] for hp in alone)
            assert max(hp.heat.rate(int(keys[-1]), now) for hp in alone) < min_rate
            # shared: hot at the fleet's rate (about the sum of the two halves)
            last = found[-1]
            assert last and min(last) >= min_rate
            own = [hp.heat.rate(int(keys[-1]), now) for hp in shared]
            assert max(last) == pytest.approx(sum(own), rel=0.2)
            assert all(hp.local_min_rate == min_rate / 2 for hp in shared)
            # one replica stops: after its TTL the fleet is the other alone
            solo = await heat[0].share_heat([(int(keys[-1]), 1.0)], 0.2)
            assert solo is not None and solo.replicas == 2
            await asyncio.sleep(0.3)
            later = await heat[1].share_heat([(int(keys[-1]), 1.5)], 5.0)
            assert later is not None and later.replicas == 1
            assert later.rates == pytest.approx((1.5,))
            redis_server.stop()
            assert await heat[1].share_heat([(int(keys[-1]), 1.5)], 5.0) is None
            copies = shared[1].hot(now)
            assert shared[1].at_fleet_rates(copies, None, ()) == [
                c for c in copies if c.prefix.rate >= min_rate
            ]
            assert shared[1].local_min_rate == min_rate
        finally:
            for h in heat:
                await h.aclose()

    run(body())
