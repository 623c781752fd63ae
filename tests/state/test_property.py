"""A property: under random interleavings of several replicas' reserve (book), prefill,
release, heartbeats, crashes and the passing of time (lease expiry), the fleet's load
in Redis equals a reference model's, and every replica's book equals the model's.

Releases and prefills are batched: queued (`release_soon`, `prefill_done_soon`), they
reach Redis with the replica's next booking, its next flush or heartbeat, or an awaited
`release` / `prefill_done`; a crash loses them with the replica. The model queues them
the same way, and also counts how many Redis applies and how many it finds unknown, so
that a batched end lost, or sent twice, fails the property (Redis alone would not show
a second release: the booking record makes it a no-op).

Time is the test's own clock (the scripts take "now" from the client when one is
given), so leases lapse exactly when the model says; the batches' timer is off
(`settle_s` of a day), so a batch goes exactly when the model says."""

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
    Shared,
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
    queued: dict[str, str] = field(default_factory=dict)  # request id -> "p" | "r"
    applied: int = 0  # queued ends Redis applied
    unknown: int = 0  # queued ends Redis had no booking for

    def settle(self) -> None:
        """The queued ends reach Redis (the lease is live), in order."""
        for rid, op in self.queued.items():
            rec = self.share.get(rid)
            if rec is None:
                self.unknown += 1
            elif op == "r":
                del self.share[rid]
                self.applied += 1
            elif not rec[3]:
                self.share[rid] = (*rec[:3], True)
                self.applied += 1
        self.queued = {}


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
        rows: dict[EngineKey, list[float]] = {}
        for r in self.replicas:
            for e, q, c, p in r.share.values():
                row = rows.setdefault(e, [0, 0, 0, 0, 0])
                row[0] += 1
                if p:
                    row[2] += 1
                    row[3] += c
                else:
                    row[1] += q
                    # its attention pairs: q new tokens after the prompt's other ones
                    row[4] += q * (max(c - q, 0) + (q + 1) / 2)
        return {e: SharedLoad(*v) for e, v in rows.items() if any(v)}


ceilings = st.sampled_from([0.0, 1.0, 2.0, 3.0, 250.0, math.inf])
replica = st.integers(0, REPLICAS - 1)
pick = st.integers(0, 50)
book = st.tuples(
    st.just("book"),
    replica,
    st.lists(
        st.tuples(st.sampled_from(ENGINES), ceilings),
        min_size=1,
        max_size=4,
        unique_by=lambda t: t[0],
    ),
    st.integers(0, 500),
    st.integers(0, 1000),
    st.integers(0, len(WEIGHTS) - 1),
)
queued = st.tuples(st.sampled_from(["prefill_soon", "release_soon"]), replica, pick)
# bookings and queued ends drawn more often than the rest: most scripts then hold
# batches of several ends that meet bookings, flushes, heartbeats and lapsed leases
ops = st.lists(
    st.one_of(
        book, book, book,
        queued, queued, queued,
        st.tuples(st.sampled_from(["prefill", "release"]), replica, pick),
        st.tuples(st.sampled_from(["flush", "beat", "crash"]), replica),
        st.tuples(st.just("advance"), st.sampled_from([50, 300, 700, 1200])),
    ),
    min_size=4,
    max_size=60,
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
            settle_s=86400.0,
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
            elif kind in ("prefill_soon", "release_soon"):
                _queue(m.replicas[i], states[i], kind, op[2])
            elif kind == "flush":
                r = m.replicas[i]
                await states[i].flush()
                if r.queued:  # a round trip only when something is queued
                    _sent(m, i)
            elif kind == "beat":
                r = m.replicas[i]
                await states[i].beat()
                m.reap()
                if r.dirty:  # resync: Redis gets the replica's book, the queue goes
                    r.share, r.deadline, r.dirty = dict(r.book), m.now + TTL_MS, False
                    r.queued = {}
                else:  # the heartbeat carries the queue
                    _sent(m, i)
            got = await loads_of(obs)
            m.reap()
            assert got == m.loads(), f"after step {step} {op}"
            for s, r in zip(states, m.replicas, strict=True):
                if not r.crashed:
                    assert s.booked() == r.book, f"after step {step} {op}"
                    assert (s.stats.ends_applied, s.stats.ends_unknown) == (
                        r.applied,
                        r.unknown,
                    ), f"after step {step} {op}"
    finally:
        for s in [*states, obs]:
            await s.close(leave=False)


def _sent(m: Model, i: int) -> None:
    """A call that carries replica i's queue reached Redis: applied under a live lease,
    else lost with the call (the replica resyncs its book later)."""
    r = m.replicas[i]
    m.reap()
    if m.live(i):
        r.settle()
        r.deadline = m.now + TTL_MS
    else:
        r.queued = {}
        r.dirty = True


async def _book(m: Model, i: int, s: RedisFleetState, op: tuple[Any, ...]) -> None:
    _, _, cands, q, c, w = op
    shortlist = [Candidate(e, ceil) for e, ceil in cands]
    weights = WEIGHTS[w]
    rid = s.new_request_id()
    m.reap()
    r = m.replicas[i]
    live = m.live(i)
    if live:
        r.settle()  # the queued ends ride on the booking, before it
    want = choose(shortlist, m.loads(), weights)[0] if live else None
    out = await s.book(rid, shortlist, prefill_tokens=q, context_tokens=c, weights=weights)
    assert out.engine is not None
    if live:
        assert isinstance(out, Booked) and out.index == want, (out, want)
        r.deadline = m.now + TTL_MS
        r.share[rid] = (out.engine, q, c, False)
    else:
        assert isinstance(out, LocalFallback) and "lease" in out.reason
        assert out.engine in {e for e, _ in cands}
        r.queued = {}
        r.dirty = True
    r.book[rid] = (out.engine, q, c, False)


def _pick(r: ModelReplica, pick: int) -> str | None:
    return sorted(r.book)[pick % len(r.book)] if r.book else None


def _queue(r: ModelReplica, s: RedisFleetState, kind: str, pick: int) -> None:
    """A queued end: the replica's book moves now, Redis later."""
    rid = _pick(r, pick)
    if rid is None:
        return
    e, q, c, p = r.book[rid]
    if kind == "prefill_soon":
        assert s.prefill_done_soon(rid) == (not p)
        if not p:
            r.book[rid] = (e, q, c, True)
            r.queued[rid] = "p"
    else:
        assert s.release_soon(rid)
        del r.book[rid]
        r.queued[rid] = "r"  # replaces a prefill not sent yet, in its place


async def _end(m: Model, i: int, s: RedisFleetState, kind: str, pick: int) -> None:
    """An awaited end: queued, then the whole queue sent at once."""
    r = m.replicas[i]
    rid = _pick(r, pick)
    if rid is None:
        return
    e, q, c, p = r.book[rid]
    if kind == "prefill":
        if p:
            await s.prefill_done(rid)  # no round trip: the replica knows
            return
        r.book[rid] = (e, q, c, True)
        r.queued[rid] = "p"
        out = await s.prefill_done(rid)
    else:
        del r.book[rid]
        r.queued[rid] = "r"
        out = await s.release(rid)
    was = rid in r.share and (kind == "release" or not r.share[rid][3])
    _sent(m, i)
    if r.dirty:
        assert isinstance(out, LocalFallback)
    else:
        assert out == Shared("ok" if was else "none"), (out, was)


@settings(
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    deadline=None,
)
@given(script=ops)
def test_shared_load_equals_the_model(
    redis_server: RedisServer, script: list[tuple[Any, ...]]
) -> None:
    run(_check(redis_server.url, script))
