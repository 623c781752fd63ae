"""`RedisFleetState`: what the gateway replicas of one fleet share through Redis.

One object per replica, used from the replica's event loop. Every operation is at most
one round trip (one Lua script, EVALSHA with an EVAL fallback on NOSCRIPT), bounded by
a latency budget; past it, or with Redis unreachable, the operation is applied to the
replica's own book and returns a `LocalFallback` instead of raising. The ends of
requests (release, prefill done) are not a round trip each: they are queued and ride on
the replica's next booking, or go as one batch at most `settle_s` later. The replica keeps
its own book of the requests it booked, so that it can put its share back in Redis
(`resync`) after an outage, a Redis restart (empty or not) or a lapsed lease.

See docs/state.md for the key layout, the leases and the failure modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import math
import os
import secrets
import socket
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    NoPermissionError,
    NoScriptError,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from quillcache.costmodel.model import booked_pairs
from quillcache.errors import ConfigError
from quillcache.gateway.secret import GatewaySecret, fingerprint
from quillcache.state import scripts
from quillcache.state.choose import choose
from quillcache.state.resp import RespConnection
from quillcache.state.types import (
    ZERO_LOAD,
    Anchor,
    Booked,
    Candidate,
    Computing,
    EngineKey,
    FleetConfig,
    LoadWeights,
    LocalFallback,
    OutsideTerms,
    PinRecord,
    SecretMismatchError,
    Shared,
    SharedLoad,
    StateError,
    StateStats,
)
from quillcache.state.urls import redacted

log = logging.getLogger(__name__)

DEFAULT_WEIGHTS = LoadWeights()
_CEILING_MAX = 1e300  # what an infinite ceiling is sent as (Lua's tonumber has no "inf")
_FIELDS = {"n": 0, "q": 1, "d": 2, "c": 3, "a": 4}


def _candidate_args(c: Candidate) -> tuple[str, str, str, str]:
    """Engine, ceiling, credit and held blocks ('' unknown), as the booking script reads
    a shortlist entry."""
    credit = f"{min(c.credit, _CEILING_MAX)!r}" if c.credit > 0 else ""
    held = "" if c.cached_blocks is None else str(int(c.cached_blocks))
    return c.engine.encode(), f"{min(c.ceiling, _CEILING_MAX)!r}", credit, held


def _outside_args(outside: OutsideTerms | None) -> tuple[str, str]:
    """The outside ceiling and credit (`OutsideTerms`), or '' and ''."""
    if outside is None:
        return "", ""
    ceiling = max(min(outside.ceiling, _CEILING_MAX), -_CEILING_MAX)
    return f"{ceiling!r}", f"{min(outside.credit, _CEILING_MAX)!r}"


# what the settle codes (scripts.settle) say, per op
_SETTLED = {"o": "ok", "n": "none", "-": "noop"}


class _Script:
    """A Lua script run by EVALSHA, by EVAL when the server does not have it (NOSCRIPT:
    a restarted or flushed Redis; EVAL caches it again)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, on: Redis | RespConnection, args: Sequence[str | int | float]) -> Any:
        if isinstance(on, RespConnection):
            try:
                return await on.call("EVALSHA", self.sha, 0, *args)
            except NoScriptError:
                return await on.call("EVAL", self.source, 0, *args)
        try:
            return await on.execute_command("EVALSHA", self.sha, 0, *args)
        except NoScriptError:
            return await on.execute_command("EVAL", self.source, 0, *args)


_BOOK = _Script(scripts.BOOK)
_RESYNC = _Script(scripts.RESYNC)
_SETTLE = _Script(scripts.SETTLE)
_LEAVE = _Script(scripts.LEAVE)
_SNAPSHOT = _Script(scripts.SNAPSHOT)
_PENDING = _Script(scripts.PENDING)
_PIN = _Script(scripts.PIN)
_UNPIN = _Script(scripts.UNPIN)
_CONFIG = _Script(scripts.CONFIG)
_PIN_TTLS = _Script(scripts.PIN_TTLS)
_SET_CONFIG = _Script(scripts.SET_CONFIG)
_SECRET = _Script(scripts.SECRET)


@dataclass(slots=True)
class _Entry:
    """A request this replica booked (in Redis or, while it could not, locally)."""

    engine: EngineKey
    prefill_tokens: int
    context_tokens: int  # its prompt
    prefilled: bool = False

    @property
    def pairs(self) -> int:
        """Its queued prefill's attention pairs, as the scripts book them (`attn`)."""
        return int(booked_pairs(self.prefill_tokens, self.context_tokens))


@dataclass(frozen=True, slots=True)
class PinResult:
    """`pinned`: the prefix is pinned for the tenant; else `owner` holds it."""

    pinned: bool
    owner: str
    shared: bool = True


class _RateLimitedLog:
    """At most one line per `every_s` per kind; the next line says how many were not
    written."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self._last: dict[str, float] = {}
        self._muted: dict[str, int] = {}

    def __call__(self, kind: str, level: int, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -math.inf) < self.every_s:
            self._muted[kind] = self._muted.get(kind, 0) + 1
            return
        muted = self._muted.pop(kind, 0)
        self._last[kind] = now
        if muted:
            msg += " (%d similar lines not logged)"
            args = (*args, muted)
        log.log(level, msg, *args)


def session_key(session_id: str) -> str:
    """A client's session id as it appears in a key name: a hash (bounded length, and
    the client's string is not stored in Redis)."""
    return hashlib.blake2b(session_id.encode(), digest_size=12).hexdigest()


def _hex(key: int) -> str:
    return f"{key & 0xFFFF_FFFF_FFFF_FFFF:016x}"


def default_replica_id() -> str:
    host = socket.gethostname().split(".")[0][:24] or "replica"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


class RedisFleetState:
    """The shared state of one fleet, as seen by one gateway replica."""

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        prefix: str = "quillcache",
        replica: str | None = None,
        lease_ttl_s: float = 3.0,
        heartbeat_s: float | None = None,
        budget_s: float = 0.010,
        admin_timeout_s: float = 1.0,
        reconnect_s: float = 0.25,
        slow_limit: int = 3,
        resync_every_s: float = 60.0,
        log_every_s: float = 10.0,
        clock: Callable[[], int] | None = None,
        client: Redis | None = None,
        fast_path: bool = True,
        settle_s: float = 0.02,
        settle_max: int = 128,
    ) -> None:
        if not prefix or any(ch in prefix for ch in "{}"):
            raise ConfigError(f"state prefix must be non-empty without braces, got {prefix!r}")
        if replica is not None and (not replica or any(ch in replica for ch in "|{} ")):
            raise ConfigError(
                f"replica id must be non-empty without '|', braces or spaces: {replica!r}"
            )
        if not lease_ttl_s > 0:
            raise ConfigError(f"lease_ttl_s must be > 0, got {lease_ttl_s}")
        heartbeat_s = lease_ttl_s / 3 if heartbeat_s is None else heartbeat_s
        if not 0 < heartbeat_s < lease_ttl_s:
            raise ConfigError(
                f"heartbeat_s must be > 0 and below lease_ttl_s ({lease_ttl_s}), got {heartbeat_s}"
            )
        if not budget_s > 0 or not admin_timeout_s > 0 or not reconnect_s > 0:
            raise ConfigError("budget_s, admin_timeout_s and reconnect_s must be > 0")
        if not settle_s > 0 or settle_max < 1:
            raise ConfigError(
                f"settle_s must be > 0 and settle_max >= 1, got {settle_s}, {settle_max}"
            )
        self.url = url
        self.prefix = prefix
        self.base = "{" + prefix + "}:"
        self.replica = replica or default_replica_id()
        self.lease_ttl_s = lease_ttl_s
        self.heartbeat_s = heartbeat_s
        self.budget_s = budget_s
        self.admin_timeout_s = admin_timeout_s
        self.reconnect_s = reconnect_s
        self.slow_limit = slow_limit
        self.resync_every_s = resync_every_s
        self._resynced_at = -math.inf
        self.stats = StateStats()
        self._ttl_ms = max(int(lease_ttl_s * 1000), 1)
        self._clock = clock
        self._client = client or Redis.from_url(
            url,
            decode_responses=True,
            socket_connect_timeout=max(admin_timeout_s, 0.1),
            # no socket timeout: every call runs under its own asyncio.timeout (a socket
            # timeout costs redis-py an asyncio.wait_for, a task, per call)
            socket_timeout=None,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        # the share-changing scripts' own pipelined connection (resp.py); None: not yet
        self.fast_path = fast_path and not url.startswith("rediss://")
        self._lane: RespConnection | None = None
        self._ids = itertools.count(1)
        self._book: dict[str, _Entry] = {}
        # request ends not sent yet: request id -> "r" (released) | "p" (prefilled), in
        # the order they came; they go with the next booking or at most settle_s later
        self.settle_s = settle_s
        self.settle_max = settle_max
        self._ends: dict[str, str] = {}
        self._end_waiters: dict[str, list[asyncio.Future[Shared | LocalFallback]]] = {}
        self._settle_timer: asyncio.TimerHandle | None = None
        self._settling: set[asyncio.Task[None]] = set()
        self._inflight = 0  # operations between the gate and their reply
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()  # closed while a resync runs
        self._open.set()
        self._up = False
        self._dirty = True  # this replica's share in Redis may differ from its book
        self._slow = 0  # consecutive timeouts
        self._secret: GatewaySecret | None = None
        self._refusal: SecretMismatchError | None = None
        self._known: dict[EngineKey, SharedLoad] = {}  # last loads seen (fallback choice)
        self._sessions: dict[str, EngineKey] = {}  # local bindings (fallback choice)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._log = _RateLimitedLog(log_every_s)
        self.epoch = ""
        self.config_version = -1  # the fleet's configuration version at the last loads()
        self._last_why = "redis too slow or failed"

    # --- lifecycle ------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Redis is in use (False: every operation falls back to the local book)."""
        return self._up

    async def start(self, secret: GatewaySecret | None = None, *, background: bool = True) -> None:
        """Connect, check the fleet's secret fingerprint, put this replica's lease in
        Redis and start the heartbeat. Raises `SecretMismatchError` when Redis holds
        another secret's fingerprint; with Redis unreachable it starts in fallback and
        does all of this when Redis comes (refusing then if the secret differs).
        `background=False`: no heartbeat task; the caller calls `beat()` (tests)."""
        self._secret = secret
        try:
            await self._connect()
        except SecretMismatchError:
            await self._client.aclose()
            raise
        except (AuthenticationError, NoPermissionError) as exc:
            await self._client.aclose()
            raise ConfigError(
                f"redis at {redacted(self.url)} refuses this replica ({type(exc).__name__}: "
                f"{exc}): give the user and password of the state URL (and its ACL "
                "rights) that the server expects"
            ) from None
        except ResponseError as exc:
            if "DB index" not in str(exc):
                self._down("start", exc)
            else:
                await self._client.aclose()
                raise ConfigError(
                    f"redis at {redacted(self.url)} has no such database ({exc}): use a "
                    "database number below the server's `databases` setting"
                ) from None
        except (RedisError, OSError, TimeoutError) as exc:
            self._down("start", exc)
        if background:
            self._task = asyncio.create_task(self._maintain(), name=f"state-{self.replica}")

    async def close(self, *, leave: bool = True) -> None:
        """Stop the heartbeat; with `leave`, take this replica's share out of Redis now
        (else it goes when the lease lapses)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        # queued request ends: leaving takes the whole share out; not leaving, the
        # lease lapses with them
        self._end_batch(self._take_ends(), None)
        if leave and self._up:
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                async with asyncio.timeout(self.admin_timeout_s):
                    await _LEAVE(await self._share_conn(), self._head())
        self._up = False
        if self._lane is not None:
            self._lane.close()
            self._lane = None
        await self._client.aclose()

    def new_request_id(self) -> str:
        """A request id unique across the fleet: this replica's id and a counter."""
        return f"{self.replica}-{next(self._ids)}"

    # --- the routed request ---------------------------------------------------------

    async def book(
        self,
        request_id: str,
        shortlist: Sequence[Candidate],
        *,
        prefill_tokens: int,
        context_tokens: int = 0,
        weights: LoadWeights = DEFAULT_WEIGHTS,
        session: str | None = None,
        session_ttl_s: float = 600.0,
        anchors: Sequence[Anchor | tuple[int, int]] = (),
        spec_ttl_s: float = 10.0,
        prompt_tokens: int = 0,
        block_size: int = 0,
        outside: OutsideTerms | None = None,
    ) -> Booked | LocalFallback:
        """The anti-herding step, one round trip: read the shortlist's shared load, take
        a candidate (`choose`), book the request on it under this replica's lease, bind
        the session to it and record its speculative placement (`anchors`: the request's
        prefix keys with their lengths in blocks and tails, `Anchor`; a pair is an anchor
        without a tail). A request id already booked returns
        its engine again (reason "retry") without booking twice.

        The prefill booked is `prefill_tokens`, or, given `prompt_tokens` and
        `block_size`, for a candidate whose `cached_blocks` is known, the prompt beyond
        the longer of those and of the request's prefix being computed there (what the
        engine will really queue: a request that joins a prefix another replica's
        request is computing queues only the rest). `Booked.prefill_tokens` says which.

        `outside`: the session's bound engine and the engines computing a part of the
        request's prefix are candidates too when the shortlist does not list them
        (`choose.outsiders`); one taken is `Booked.index` -1. The local fallback
        weighs the shortlist only (this replica does not know the fleet's bindings and
        placements)."""
        if not shortlist:
            raise StateError("book() needs a non-empty shortlist")
        old = self._book.get(request_id)
        if old is not None:
            return Booked(
                old.engine, _position(shortlist, old.engine), "retry", (), old.prefill_tokens
            )
        if prompt_tokens < 0 or block_size < 0:
            raise StateError(
                f"prompt_tokens and block_size must be >= 0, got {prompt_tokens}, {block_size}"
            )
        ends = self._take_ends()
        args = self._head()
        args += [
            request_id,
            int(prefill_tokens),
            int(context_tokens),
            repr(weights.in_flight),
            repr(weights.queued_tokens),
            repr(weights.decodes),
            session_key(session) if session else "",
            max(int(session_ttl_s * 1000), 1),
            max(int(spec_ttl_s * 1000), 1),
            int(prompt_tokens),
            int(block_size),
            *_outside_args(outside),
            len(shortlist),
            len(anchors),
            len(ends),
        ]
        for c in shortlist:
            args += _candidate_args(c)
        for a in anchors:
            k, b, tail = Anchor(*a)
            args += (_hex(k), int(b), tail)
        args += ends
        reply = await self._run("book", _BOOK, args, self.budget_s, share=True)
        status = reply[0] if reply is not None else None
        if ends:
            codes = reply[3] if status == "ok" else reply[2] if status == "dup" else None
            self._end_batch(ends, codes)
        if status == "ok":
            i = int(reply[1]) - 1  # -1: an engine outside the shortlist
            booked_prefill = int(reply[4])
            v = reply[6:]  # integers already (hiredis, or redis-py's RESP parser)
            loads = tuple(
                SharedLoad(v[j], v[j + 1], v[j + 2], v[j + 3], v[j + 4])
                for j in range(0, 5 * len(shortlist), 5)
            )
            engine = shortlist[i].engine if i >= 0 else EngineKey.decode(reply[5])
            for c, ld in zip(shortlist, loads, strict=True):
                self._known[c.engine] = ld
            self._note(request_id, engine, booked_prefill, context_tokens, session)
            self.stats.booked += 1
            return Booked(engine, i, str(reply[2]), loads, booked_prefill)
        if status == "dup":  # a booking that reached Redis from an earlier attempt
            engine = EngineKey.decode(reply[1])
            self._note(request_id, engine, prefill_tokens, context_tokens, session)
            return Booked(engine, _position(shortlist, engine), "retry", (), int(prefill_tokens))
        reason = self._lost("book") if status == "lost" else self._why()
        i, _ = choose(
            shortlist,
            self._known,
            weights,
            session_engine=self._sessions.get(session) if session else None,
        )
        engine = shortlist[i].engine
        held = shortlist[i].cached_blocks
        local_prefill = (
            max(prompt_tokens - held * block_size, 1)
            if prompt_tokens > 0 and block_size > 0 and held is not None
            else int(prefill_tokens)
        )
        self._note(request_id, engine, local_prefill, context_tokens, session)
        self.stats.fell_back_bookings += 1
        return LocalFallback(reason, engine, local_prefill)

    def prefill_done_soon(self, request_id: str) -> bool:
        """The request's prompt is computed: its queued prefill turns into a decode, in
        this replica's view now and in Redis with its next call (a booking, or the batch
        sent at most `settle_s` later). False: not booked here, or already prefilled."""
        e = self._book.get(request_id)
        if e is None or e.prefilled:
            return False
        e.prefilled = True
        self._adjust(
            e.engine,
            queued=-e.prefill_tokens,
            pairs=-e.pairs,
            decodes=1,
            context=e.context_tokens,
        )
        self._queue_end(request_id, "p")
        return True

    def release_soon(self, request_id: str) -> bool:
        """The request ended (done or failed): its load leaves the engine, in this
        replica's view now and in Redis with its next call. False: not booked here."""
        e = self._book.pop(request_id, None)
        if e is None:
            return False
        if e.prefilled:
            self._adjust(e.engine, in_flight=-1, decodes=-1, context=-e.context_tokens)
        else:
            self._adjust(e.engine, in_flight=-1, queued=-e.prefill_tokens, pairs=-e.pairs)
        self._queue_end(request_id, "r")
        return True

    async def prefill_done(self, request_id: str) -> Shared | LocalFallback:
        """`prefill_done_soon`, sent now (with whatever else is queued); returns once
        Redis has it."""
        e = self._book.get(request_id)
        if e is None:
            return Shared("unknown request")
        if e.prefilled:
            return Shared("already prefilled")
        self.prefill_done_soon(request_id)
        return await self._sent(request_id)

    async def release(self, request_id: str) -> Shared | LocalFallback:
        """`release_soon`, sent now (with whatever else is queued); returns once Redis
        has it."""
        if not self.release_soon(request_id):
            return Shared("unknown request")
        return await self._sent(request_id)

    async def flush(self) -> None:
        """Send the queued request ends now, in one round trip (with the lease's
        renewal)."""
        if self._ends:
            await self._settle("settle", self.budget_s)

    def _queue_end(self, request_id: str, op: str) -> None:
        if not self._up:  # the book has it; the resync after the reconnect sends it
            self._fallback("release" if op == "r" else "prefill_done")
            return
        # a prefill not sent yet and then the release: the release alone (the booking
        # record in Redis still says "queued", and the release takes back what it says)
        self._ends[request_id] = op
        if len(self._ends) >= self.settle_max:
            self._settle_soon()
        elif self._settle_timer is None:
            self._settle_timer = asyncio.get_running_loop().call_later(
                self.settle_s, self._settle_soon
            )

    def _settle_soon(self) -> None:
        """The batch's timer (or a full batch): one task per batch, not per request."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        task = asyncio.ensure_future(self.flush())
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    def _take_ends(self) -> list[str]:
        """The queued ends as script arguments ('r' or 'p', then the request id), taken
        off the queue."""
        if self._settle_timer is not None:
            self._settle_timer.cancel()
            self._settle_timer = None
        if not self._ends:
            return []
        ends = [op + rid for rid, op in self._ends.items()]
        self._ends = {}
        return ends

    async def _sent(self, request_id: str) -> Shared | LocalFallback:
        """Send the queue now and wait for the request's own end to be answered."""
        if request_id not in self._ends:  # not queued: Redis is not in use
            return LocalFallback(self._why())
        fut: asyncio.Future[Shared | LocalFallback] = asyncio.get_running_loop().create_future()
        self._end_waiters.setdefault(request_id, []).append(fut)
        await self.flush()
        return await fut

    async def _settle(self, op: str, timeout_s: float) -> None:
        """The SETTLE script: renew the lease and send the queued ends."""
        ends = self._take_ends()
        reply = await self._run(op, _SETTLE, [*self._head(), *ends], timeout_s, share=True)
        if reply is not None and reply[0] == "lost":
            self._lost(op)
        if ends:
            self.stats.end_batches += 1
            self._end_batch(ends, reply[2] if reply is not None and reply[0] == "ok" else None)

    def _end_batch(self, ends: Sequence[str], codes: str | None) -> None:
        """Count a batch of ends Redis answered (`codes`, one character per end) or did
        not (None: the call failed; the share is dirty and a resync puts the book back),
        and answer whoever waits for one of them."""
        if not ends:
            return
        stats = self.stats
        stats.ends_sent += len(ends)
        if codes is None:
            failed = LocalFallback(self._why())
            self._answer(ends, lambda i: failed)
        else:
            stats.ends_applied += codes.count("o")
            stats.ends_unknown += codes.count("n")
            self._answer(ends, lambda i: Shared(_SETTLED[codes[i]]))

    def _answer(self, ends: Sequence[str], result: Callable[[int], Shared | LocalFallback]) -> None:
        """Answer the callers waiting for some of `ends` (`release()`, `prefill_done()`)."""
        waiters = self._end_waiters
        if not waiters or not ends:
            return
        for i, end in enumerate(ends):
            for fut in waiters.pop(end[1:], ()):
                if not fut.done():
                    fut.set_result(result(i))

    # --- reads ----------------------------------------------------------------------

    async def loads(self) -> dict[EngineKey, SharedLoad] | LocalFallback:
        """Every engine key's booked load over the fleet's live replicas (keys with no
        load are absent). One round trip (on the fast connection: a poll every few
        hundred ms per replica); also reaps dead replicas, and reads the fleet's
        configuration version (`config_version`), so that a poller reads `config()`
        only when it moved."""
        reply = await self._run("loads", _SNAPSHOT, self._head(), self.admin_timeout_s, share=True)
        if reply is None:
            return LocalFallback(self._why())
        self.config_version = int(reply[0])
        self.epoch = str(reply[1])
        rows: dict[EngineKey, list[int]] = {}
        for i in range(2, len(reply), 2):
            name, _, f = str(reply[i]).partition("|")
            row = rows.setdefault(EngineKey.decode(name), [0, 0, 0, 0, 0])
            row[_FIELDS[f]] = int(reply[i + 1])
        out = {k: SharedLoad(*v) for k, v in rows.items()}
        self._known = dict(out)
        return out

    async def pending(
        self, anchors: Sequence[Anchor | tuple[int, int]]
    ) -> dict[EngineKey, Computing] | LocalFallback:
        """Per engine key, the longest prefix of the request (`Anchor`s; a pair is an
        anchor without a tail) that a request routed by any replica is computing there
        now: an anchor's depth, or deeper on the engine first placed on it as far as its
        tail matches; and the engine's place among those computing that anchor
        (`Computing`)."""
        args: list[str | int | float] = self._head()
        for a in anchors:
            k, _, tail = Anchor(*a)
            args += (_hex(k), tail)
        reply = await self._run("pending", _PENDING, args, self.budget_s)
        if reply is None:
            return LocalFallback(self._why())
        out: dict[EngineKey, Computing] = {}
        seen = Counter[int]()  # per anchor, the engines read so far: the next one's rank
        for i in range(0, len(reply), 3):
            j = int(reply[i])
            engine = EngineKey.decode(str(reply[i + 1]))
            at = Computing(int(anchors[j - 1][1]) + int(reply[i + 2]), seen[j])
            seen[j] += 1
            held = out.get(engine)
            if held is None or (-at.blocks, at.rank) < (-held.blocks, held.rank):
                out[engine] = at
        return out

    async def session(self, session_id: str) -> EngineKey | LocalFallback | None:
        """The engine a session is bound to (by `book(..., session=...)`), if any."""
        key = self.base + "sess:" + session_key(session_id)
        reply = await self._run("session", None, ["GET", key], self.budget_s)
        if reply is _FAILED:
            return LocalFallback(self._why())
        return EngineKey.decode(str(reply)) if reply else None

    # --- what the admin API changes -------------------------------------------------

    async def pin(self, prefix_key: int, tenant: str, ttl_s: float) -> PinResult | LocalFallback:
        """Pin a prefix for `tenant` until `ttl_s` from now (again: extends it); refused
        (`pinned=False`) while another tenant holds it."""
        args = [*self._head(), _hex(prefix_key), tenant, max(int(ttl_s * 1000), 1)]
        reply = await self._run("pin", _PIN, args, self.admin_timeout_s)
        if reply is None:
            return LocalFallback(self._why())
        return PinResult(reply[0] == "ok", tenant if reply[0] == "ok" else str(reply[1]))

    async def unpin(self, prefix_key: int, tenant: str) -> PinResult | LocalFallback:
        reply = await self._run(
            "unpin", _UNPIN, [*self._head(), _hex(prefix_key), tenant], self.admin_timeout_s
        )
        if reply is None:
            return LocalFallback(self._why())
        if reply[0] == "owned":
            return PinResult(True, str(reply[1]))
        return PinResult(False, "")

    async def put_pin_chain(self, prefix_key: int, chain: Sequence[int]) -> Shared | LocalFallback:
        """The content keys of a pinned prefix (its blocks, first to last), so that every
        replica can pin the same blocks in its own index (`pin` names the prefix only)."""
        key = self.base + "pinkeys"
        value = ",".join(_hex(k) for k in chain)
        reply = await self._run(
            "pin", None, ["HSET", key, _hex(prefix_key), value], self.admin_timeout_s
        )
        return LocalFallback(self._why()) if reply is _FAILED else Shared()

    async def put_pin_record(self, prefix_key: int, record: PinRecord) -> Shared | LocalFallback:
        """What warming a pinned prefix takes (its tokens, model and salt), so that every
        replica keeps it warm, not only the one it was made through."""
        value = json.dumps({"model": record.model, "salt": record.salt, "tokens": record.tokens})
        reply = await self._run(
            "pin",
            None,
            ["HSET", self.base + "pinrec", _hex(prefix_key), value],
            self.admin_timeout_s,
        )
        return LocalFallback(self._why()) if reply is _FAILED else Shared()

    async def pin_records(self, prefix_keys: Sequence[int]) -> dict[int, PinRecord] | LocalFallback:
        """The records `put_pin_record` stored for these prefixes (those it has)."""
        if not prefix_keys:
            return {}
        reply = await self._run(
            "config",
            None,
            ["HMGET", self.base + "pinrec", *(_hex(k) for k in prefix_keys)],
            self.admin_timeout_s,
        )
        if reply is _FAILED:
            return LocalFallback(self._why())
        out: dict[int, PinRecord] = {}
        for k, v in zip(prefix_keys, reply, strict=True):
            if not v:
                continue
            try:
                d = json.loads(v)
                out[k] = PinRecord(str(d["model"]), d["salt"], [int(t) for t in d["tokens"]])
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("shared state: pin %s has a malformed record: %s", _hex(k), exc)
        return out

    async def drop_pin_chain(self, prefix_key: int) -> Shared | LocalFallback:
        """The chain and the record of a prefix no longer pinned."""
        out: Shared | LocalFallback = Shared()
        for name in ("pinkeys", "pinrec"):
            reply = await self._run(
                "unpin", None, ["HDEL", self.base + name, _hex(prefix_key)], self.admin_timeout_s
            )
            if reply is _FAILED:
                out = LocalFallback(self._why())
        return out

    async def pin_chains(self, prefix_keys: Sequence[int]) -> dict[int, list[int]] | LocalFallback:
        """The chains `put_pin_chain` stored for these prefixes (those it has)."""
        if not prefix_keys:
            return {}
        key = self.base + "pinkeys"
        reply = await self._run(
            "config", None, ["HMGET", key, *(_hex(k) for k in prefix_keys)], self.admin_timeout_s
        )
        if reply is _FAILED:
            return LocalFallback(self._why())
        return {
            k: [int(x, 16) for x in str(v).split(",") if x]
            for k, v in zip(prefix_keys, reply, strict=True)
            if v
        }

    async def pin_ttls(self, prefix_keys: Sequence[int]) -> dict[int, float] | LocalFallback:
        """The seconds left of these pins by Redis's clock (those still pinned): a pin
        made through another replica, whose TTL this replica does not keep."""
        if not prefix_keys:
            return {}
        args = [*self._head(), *(_hex(k) for k in prefix_keys)]
        reply = await self._run("config", _PIN_TTLS, args, self.admin_timeout_s)
        if reply is None:
            return LocalFallback(self._why())
        return {k: int(ms) / 1000 for k, ms in zip(prefix_keys, reply, strict=True) if int(ms) >= 0}

    async def set_draining(
        self, engine: EngineKey, draining: bool = True
    ) -> Shared | LocalFallback:
        return await self._set_config("draining", engine.encode(), "1" if draining else "")

    async def add_engine(self, engine: int, spec: Mapping[str, Any]) -> Shared | LocalFallback:
        """An engine added through the admin API (its spec: whatever the gateway needs to
        reach it, as JSON)."""
        return await self._set_config(
            "engines", str(int(engine)), json.dumps(dict(spec), sort_keys=True)
        )

    async def remove_engine(self, engine: int) -> Shared | LocalFallback:
        return await self._set_config("engines", str(int(engine)), "")

    async def config(self) -> FleetConfig | LocalFallback:
        """Engines added at run time, draining flags and live pins, in one round trip;
        `version` changes whenever one of them does (poll `loads()`'s cheaper twin, or
        this, every few hundred ms)."""
        reply = await self._run("config", _CONFIG, self._head(), self.admin_timeout_s)
        if reply is None:
            return LocalFallback(self._why())
        version = int(reply[0])
        at = 1
        parts: list[list[str]] = []
        for _ in range(2):
            n = int(reply[at])
            parts.append([str(x) for x in reply[at + 1 : at + 1 + n]])
            at += 1 + n
        pins_kv = [str(x) for x in reply[at:]]
        engines = {
            int(k): json.loads(v) for k, v in zip(parts[0][::2], parts[0][1::2], strict=True)
        }
        draining = frozenset(EngineKey.decode(k) for k in parts[1][::2])
        pins = {int(k, 16): v for k, v in zip(pins_kv[::2], pins_kv[1::2], strict=True)}
        return FleetConfig(version, engines, draining, pins)

    async def _set_config(self, table: str, field: str, value: str) -> Shared | LocalFallback:
        reply = await self._run(
            table, _SET_CONFIG, [*self._head(), table, field, value], self.admin_timeout_s
        )
        if reply is None:
            return LocalFallback(self._why())
        return Shared("changed" if int(reply[1]) else "unchanged")

    # --- this replica's share -------------------------------------------------------

    def booked(self) -> dict[str, tuple[EngineKey, int, int, bool]]:
        """This replica's own book: request id -> (engine, prefill, context, prefilled)."""
        return {
            rid: (e.engine, e.prefill_tokens, e.context_tokens, e.prefilled)
            for rid, e in self._book.items()
        }

    async def resync(self) -> bool:
        """Replace this replica's share in Redis with its book (after an outage, a Redis
        restart, a lapsed lease or a timed-out call). Waits for this replica's calls in
        flight and holds new ones back meanwhile; True when done."""
        if self._refusal is not None:
            return False
        self._open.clear()
        try:
            async with asyncio.timeout(self.admin_timeout_s):
                await self._idle.wait()
                # the book has every queued end already: Redis gets the book instead
                self._answer(self._take_ends(), lambda i: Shared("resynced"))
                args: list[str | int | float] = self._head()
                for rid, e in self._book.items():
                    args += [
                        rid,
                        e.engine.encode(),
                        e.prefill_tokens,
                        e.context_tokens,
                        int(e.prefilled),
                    ]
                await _RESYNC(await self._share_conn(), args)
        except (RedisError, OSError, TimeoutError) as exc:
            self._down("resync", exc)
            return False
        finally:
            self._open.set()
        self._dirty = False
        self._resynced_at = time.monotonic()
        self.stats.resyncs += 1
        return True

    # --- internals ------------------------------------------------------------------

    def _head(self) -> list[str | int | float]:
        now = "" if self._clock is None else str(int(self._clock()))
        return [self.base, self.replica, self._ttl_ms, now]

    async def _share_conn(self) -> Redis | RespConnection:
        """Where the share-changing scripts go: the fast connection (opened again after
        it was lost), or the redis client without the fast path."""
        if not self.fast_path:
            return self._client
        lane = self._lane
        if lane is None or not lane.usable:
            if lane is not None:
                lane.close()
            self._lane = None
            lane = self._lane = await RespConnection.open(self.url)
        return lane

    async def _run(
        self,
        op: str,
        script: _Script | None,
        args: Sequence[str | int | float],
        timeout_s: float,
        *,
        share: bool = False,
    ) -> Any:
        """One round trip within `timeout_s`; None (or `_FAILED` for plain commands)
        when it could not be had: the caller falls back. `share`: a script that changes
        this replica's share (the fast connection)."""
        failed = None if script is not None else _FAILED
        if not self._up:
            self._fallback(op)
            return failed
        lane = self._lane
        try:
            if (
                share
                and script is not None
                and lane is not None
                and lane.usable
                and self._open.is_set()
                and self.fast_path
            ):
                out = await self._on_lane(lane, script, args, timeout_s)
            else:
                # wait_for, not asyncio.timeout: the booking may run outside a task
                # (`gateway.eager`)
                out = await asyncio.wait_for(self._call(script, args, share), timeout_s)
        except TimeoutError:
            self.stats.timeouts += 1
            self._dirty = True  # the call may still reach Redis: resync on the next beat
            self._slow += 1
            if self._slow >= self.slow_limit:
                self._down(
                    op, TimeoutError(f"{self._slow} calls in a row over {timeout_s * 1000:.1f} ms")
                )
            self._last_why = f"redis slower than the {timeout_s * 1000:.1f} ms budget"
            self._fallback(op, self._last_why)
            return failed
        except (RedisError, OSError) as exc:
            if _is_connection_error(exc):
                self._down(op, exc)
            else:
                self._dirty = True
                self._last_why = f"redis error: {exc}"
                self._log("error", logging.WARNING, "shared state: %s failed in redis: %s", op, exc)
            self._fallback(op)
            return failed
        self._slow = 0
        return out

    async def _call(
        self, script: _Script | None, args: Sequence[str | int | float], share: bool
    ) -> Any:
        """`_run`'s other case: after a resync under way, on the redis client (or the
        fast connection, opened again)."""
        if not self._open.is_set():
            await self._open.wait()
        self._inflight += 1
        self._idle.clear()
        try:
            if script is None:
                return await self._client.execute_command(*args)
            if share:
                return await script(await self._share_conn(), args)
            return await script(self._client, args)
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def _on_lane(
        self,
        lane: RespConnection,
        script: _Script,
        args: Sequence[str | int | float],
        timeout_s: float,
    ) -> Any:
        """`_run`'s common case, a script on the open fast connection, without
        `asyncio.timeout` (a context object and a rescheduled timer per call, the
        largest part of this layer's own CPU per booking): the reply's future fails
        with TimeoutError at the budget, and the connection drops the late reply."""
        loop = asyncio.get_running_loop()
        self._inflight += 1
        self._idle.clear()
        fut = lane.call("EVALSHA", script.sha, 0, *args)
        timer = loop.call_later(timeout_s, _expire, fut)
        try:
            try:
                return await fut
            except NoScriptError:  # a restarted or flushed server: EVAL caches it again
                timer.cancel()
                fut = lane.call("EVAL", script.source, 0, *args)
                timer = loop.call_later(timeout_s, _expire, fut)
                return await fut
        finally:
            timer.cancel()
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    def _fallback(self, op: str, why: str | None = None) -> None:
        self.stats.fallback(op)
        self._log(
            "fallback",
            logging.WARNING,
            "shared state: %s used this replica's local state (%s)",
            op,
            why or self._why(),
        )

    def _why(self) -> str:
        if self._refusal is not None:
            return f"refused: {self._refusal}"
        if not self._up:
            return "redis unreachable"
        return self._last_why

    def _lost(self, op: str) -> str:
        """Redis did not hold this replica's lease (it restarted, was flushed, or this
        replica paused past its TTL): put the share back as soon as possible."""
        self.stats.lost_leases += 1
        self.stats.fallback(op)
        self._dirty = True
        self._wake.set()
        self._log(
            "lost",
            logging.WARNING,
            "shared state: redis lost this replica's lease; resynchronising",
        )
        return "lease lost in redis; resynchronising"

    def _note(
        self, rid: str, engine: EngineKey, prefill: int, context: int, session: str | None
    ) -> None:
        self._book[rid] = _Entry(engine, int(prefill), int(context))
        e = self._book[rid]
        self._adjust(engine, in_flight=1, queued=e.prefill_tokens, pairs=e.pairs)
        if session:
            if len(self._sessions) > 100_000:
                self._sessions.clear()
            self._sessions[session] = engine

    def _adjust(
        self,
        engine: EngineKey,
        in_flight: int = 0,
        queued: int = 0,
        decodes: int = 0,
        context: int = 0,
        pairs: int = 0,
    ) -> None:
        """Keep the last known loads (the fallback's view) moving with this replica's
        own bookings."""
        ld = self._known.get(engine, ZERO_LOAD)
        self._known[engine] = SharedLoad(
            max(ld.in_flight + in_flight, 0),
            max(ld.queued_prefill_tokens + queued, 0),
            max(ld.running_decodes + decodes, 0),
            max(ld.context_tokens + context, 0),
            max(ld.queued_prefill_pairs + pairs, 0),
        )

    def _down(self, op: str, exc: BaseException) -> None:
        if self._up:
            self.stats.disconnects += 1
        self._up = False
        self._dirty = True
        self._log(
            "down",
            logging.WARNING,
            "shared state: redis at %s unusable during %s (%s: %s); routing on local state "
            "and reconnecting every %.2f s",
            redacted(self.url),
            op,
            type(exc).__name__,
            exc,
            self.reconnect_s,
        )
        self._wake.set()

    async def _connect(self) -> None:
        """Ping, check the secret, put the share back; raises on failure."""
        async with asyncio.timeout(self.admin_timeout_s):
            await self._client.execute_command("PING")
            await self._share_conn()
            if self._secret is not None:
                await self._check_secret(self._secret)
            await self._warn_eviction()
        self._up = True
        if not await self.resync():
            raise TimeoutError("resync did not complete")

    async def _check_secret(self, secret: GatewaySecret) -> None:
        prev = ""
        until_ms = 0
        if secret.previous is not None and secret.previous_until:
            prev = fingerprint(secret.previous)
            until_ms = int(secret.previous_until * 1000)
        reply = await _SECRET(
            self._client,
            [*self._head(), secret.fingerprint, prev, until_ms, secrets.token_hex(8)],
        )
        status, stored, self.epoch = str(reply[0]), str(reply[1]), str(reply[2])
        if status == "mismatch":
            self._refusal = SecretMismatchError(
                f"this replica's gateway secret (fingerprint {secret.fingerprint}, file "
                f"{secret.path or '?'}) is not the one fleet {self.prefix!r} in Redis uses "
                f"(fingerprint {stored}): give every replica of a fleet the same secret file "
                "(copy it from a running replica, or mount the same secret store), or give "
                "this replica another state prefix if it belongs to another fleet"
            )
            raise self._refusal
        self._refusal = None
        if status == "rotated":
            log.warning(
                "shared state: fleet %r moves to secret fingerprint %s (was %s)",
                self.prefix,
                secret.fingerprint,
                stored,
            )

    async def _warn_eviction(self) -> None:
        """Eviction of a share or a lease would corrupt the sum: say so once."""
        with contextlib.suppress(RedisError):
            policy = await self._client.execute_command("CONFIG", "GET", "maxmemory-policy")
            value = policy.get("maxmemory-policy") if isinstance(policy, dict) else policy[1]
            if value and value != "noeviction":
                log.warning(
                    "shared state: redis maxmemory-policy is %s; set it to noeviction (an "
                    "evicted share or lease makes the fleet's load wrong until a resync)",
                    value,
                )

    async def beat(self) -> None:
        """One step of the heartbeat: reconnect while Redis is down, resync when this
        replica's share may be wrong or every `resync_every_s` (a call that timed out
        may reach Redis after the resync that followed it), else renew the lease (and
        reap dead replicas)."""
        if not self._up:
            await self._reconnect()
        elif self._dirty or time.monotonic() - self._resynced_at > self.resync_every_s:
            await self.resync()
        else:
            await self._settle("renew", self.admin_timeout_s)

    async def _maintain(self) -> None:
        """`beat()` every `heartbeat_s` while Redis is up, every `reconnect_s` while it
        is not, and at once when an operation found the lease lost."""
        while not self._closed:
            interval = self.heartbeat_s if self._up else self.reconnect_s
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()
            self._wake.clear()
            try:
                await self.beat()
            except asyncio.CancelledError:
                raise
            except Exception:  # the heartbeat must outlive anything a call can raise
                log.exception("shared state: heartbeat failed")

    async def _reconnect(self) -> None:
        try:
            await self._connect()
        except SecretMismatchError as exc:
            self._up = False
            self._log("refused", logging.ERROR, "shared state: %s", exc)
            return
        except (RedisError, OSError, TimeoutError):
            self._up = False
            return
        self.stats.reconnects += 1
        log.warning(
            "shared state: redis at %s is back; this replica's %d bookings resynchronised",
            redacted(self.url),
            len(self._book),
        )


_FAILED = object()


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


def _position(shortlist: Sequence[Candidate], engine: EngineKey) -> int:
    for i, c in enumerate(shortlist):
        if c.engine == engine:
            return i
    return -1


def _is_connection_error(exc: BaseException) -> bool:
    return isinstance(exc, RedisConnectionError | RedisTimeoutError | BusyLoadingError | OSError)
