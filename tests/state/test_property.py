"""A property: under random interleavings of several replicas' reserve (book), prefill,
release, heartbeats, crashes and the passing of time (lease expiry), the fleet's load
in Redis equals a reference model's, and every replica's book equals the model's.

Time is the test's own clock (the scripts take "now" from the client when one is
given), so leases lapse exactly when the model says."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.state import (
    Booked,
    Candidate,
    EngineKey,
    LoadWeights,
    LocalFallback,
    RedisFleetState,
    SharedLoad,
    choose,
)
from tests.state.helpers import fleet, loads_of, run
from tests.state.server import RedisServer

TTL_MS = 1000
REPLICAS = 3
ENGINES = [EngineKey(0), EngineKey(1), EngineKey(2, 0), EngineKey(2, 1), EngineKey(3)]
WEIGHTS = [LoadWeights(), LoadWeights(1.0, 0.01, 0.5), LoadWeights(0.0, 1.0, 0.0)]

Entry = tuple[EngineKey, int, int, bool]


@dataclass
class ModelReplica:
    book: dict[str, Entry] = field(default_factory=dict)  # the replica's own
    share: dict[str, Entry] = field(default_factory=dict)  # what Redis holds for it
    deadline: int | None = None  # its lease in Redis; None: none
    dirty: bool = False
    crashed: bool = False


@dataclass
class Model:
    now: int = 1_000_000
    replicas: list[ModelReplica] = field(default_factory=list)

    def reap(self) -> None:  # every script does this first
        for r in self.replicas:
            if r.deadline is not None and r.deadline <= self.now:
                r.deadline, r.share = None, {}

    def live(self, i: int) -> bool:
        d = self.replicas[i].deadline
        return d is not None and d > self.now

    def loads(self) -> dict[EngineKey, SharedLoad]:
        rows: dict[EngineKey, list[int]] = {}
        for r in self.replicas:
            for e, q, c, p in r.share.values():
                row = rows.setdefault(e, [0, 0, 0, 0])
                row[0] += 1
                if p:
                    row[2] += 1
                    row[3] += c
                else:
                    row[1] += q
        return {e: SharedLoad(*v) for e, v in rows.items() if any(v)}


ceilings = st.sampled_from([0.0, 1.0, 2.0, 3.0, 250.0, math.inf])
ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("book"),
            st.integers(0, REPLICAS - 1),
            st.lists(st.tuples(st.sampled_from(ENGINES), ceilings), min_size=1, max_size=4,
                     unique_by=lambda t: t[0]),
            st.integers(0, 500),
            st.integers(0, 1000),
            st.integers(0, len(WEIGHTS) - 1),
        ),
        st.tuples(st.just("prefill"), st.integers(0, REPLICAS - 1), st.integers(0, 50)),
        st.tuples(st.just("release"), st.integers(0, REPLICAS - 1), st.integers(0, 50)),
        st.tuples(st.just("beat"), st.integers(0, REPLICAS - 1)),
        st.tuples(st.just("advance"), st.sampled_from([50, 300, 700, 1200])),
        st.tuples(st.just("crash"), st.integers(0, REPLICAS - 1)),
    ),
    max_size=40,
)  # fmt: skip


async def _check(url: str, script: list[tuple[Any, ...]]) -> None:
    m = Model()
    prefix = fleet()

    def clock() -> int:
        return m.now

    states = [
        RedisFleetState(
            url,
            prefix=prefix,
            replica=f"r{i}",
            budget_s=5.0,
            lease_ttl_s=TTL_MS / 1000,
            resync_every_s=math.inf,  # a beat renews unless the model says it resyncs
            clock=clock,
        )
        for i in range(REPLICAS)
    ]
    obs = RedisFleetState(url, prefix=prefix, replica="observer", budget_s=5.0, clock=clock)
    await obs.start(background=False)
    for s in states:
        await s.start(background=False)
        m.reap()
        m.replicas.append(ModelReplica(deadline=m.now + TTL_MS))
    try:
        for step, op in enumerate(script):
            kind, i = op[0], op[1]
            if kind == "advance":
                m.now += i
            elif m.replicas[i].crashed:
                continue
            elif kind == "crash":
                m.replicas[i].crashed = True
            elif kind == "book":
                await _book(m, i, states[i], op)
            elif kind in ("prefill", "release"):
                await _end(m, i, states[i], kind, op[2])
            elif kind == "beat":
                r = m.replicas[i]
                await states[i].beat()
                m.reap()
                if r.dirty:  # resync: Redis gets the replica's book
                    r.share, r.deadline, r.dirty = dict(r.book), m.now + TTL_MS, False
                elif m.live(i):
                    r.deadline = m.now + TTL_MS
                else:
                    r.dirty = True  # found its lease lost
            got = await loads_of(obs)
            m.reap()
            assert got == m.loads(), f"after step {step} {op}"
            for s, r in zip(states, m.replicas, strict=True):
                if not r.crashed:
                    assert s.booked() == r.book, f"after step {step} {op}"
    finally:
        for s in [*states, obs]:
            await s.close(leave=False)


async def _book(m: Model, i: int, s: RedisFleetState, op: tuple[Any, ...]) -> None:
    _, _, cands, q, c, w = op
    shortlist = [Candidate(e, ceil) for e, ceil in cands]
    weights = WEIGHTS[w]
    rid = s.new_request_id()
    m.reap()
    live = m.live(i)
    want = choose(shortlist, m.loads(), weights)[0] if live else None
    out = await s.book(rid, shortlist, prefill_tokens=q, context_tokens=c, weights=weights)
    r = m.replicas[i]
    assert out.engine is not None
    if live:
        assert isinstance(out, Booked) and out.index == want, (out, want)
        r.deadline = m.now + TTL_MS
        r.share[rid] = (out.engine, q, c, False)
    else:
        assert isinstance(out, LocalFallback) and "lease" in out.reason
        assert out.engine in {e for e, _ in cands}
        r.dirty = True
    r.book[rid] = (out.engine, q, c, False)


async def _end(m: Model, i: int, s: RedisFleetState, kind: str, pick: int) -> None:
    r = m.replicas[i]
    if not r.book:
        return
    rid = sorted(r.book)[pick % len(r.book)]
    e, q, c, p = r.book[rid]
    if kind == "prefill":
        if p:
            await s.prefill_done(rid)  # no round trip: the replica knows
            return
        r.book[rid] = (e, q, c, True)
        out = await s.prefill_done(rid)
    else:
        del r.book[rid]
        out = await s.release(rid)
    m.reap()
    if not m.live(i):
        assert isinstance(out, LocalFallback)
        r.dirty = True
        return
    r.deadline = m.now + TTL_MS
    if rid in r.share:
        if kind == "release":
            del r.share[rid]
        elif not r.share[rid][3]:
            r.share[rid] = (e, q, c, True)


@settings(
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    deadline=None,
)
@given(script=ops)
def test_shared_load_equals_the_model(
    redis_server: RedisServer, script: list[tuple[Any, ...]]
) -> None:
    run(_check(redis_server.url, script))
