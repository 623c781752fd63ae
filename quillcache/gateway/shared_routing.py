"""Booking through the fleet's shared state (`--state redis://...`): the route path's
second step after the control plane's decision.

    decision = plane.route(request)               # the router scores locally (its view
                                                  # captured by `ViewCapture`)
    route = await shared.book(request, w, rank)   # one round trip: the shortlist (the
                                                  # router's choice first) booked in Redis
    ... forward to route.worker, rank route.rank
    shared.prefill_done(rid); shared.release(rid) # from `RequestOutcomes`: queued, they
                                                  # ride on the next booking (or go as
                                                  # one batch `settle_s` later)

Engines are named in Redis by a fleet-wide id derived from their URL (`fleet_engine_id`),
not by this replica's worker ids: replicas number their workers in the order they were
configured or added, which need not agree. `EngineIds` maps one to the other.

Booking ids are `RedisFleetState.new_request_id()` (unique across the fleet); a retried
request books again under a new id, its first booking released. When the booking falls
back (Redis down, over budget, lease lost) the request goes where `choose` over this
replica's last known loads puts it (`LocalFallback.engine`); `RedisFleetState` writes the
rate-limited log line, `on_booked` counts it.

The plane tracks the request on the router's choice (its speculative prefix there); when
the booking takes another candidate, the caller moves it there (`ControlPlane.move`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quillcache.routing import Decision, Router, View
from quillcache.routing import Request as RouteRequest
from quillcache.routing.shortlist import ShortlistContractError, check_preferences
from quillcache.state import (
    Booked,
    Candidate,
    EngineKey,
    LocalFallback,
    OutsideTerms,
    RedisFleetState,
)
from quillcache.state.load_store import SharedLoadStore
from quillcache.state.shortlist import (
    Shortlist,
    ShortlistPolicy,
    anchors,
    build_shortlist,
    prefill_tokens,
    shortlist_of,
)

log = logging.getLogger(__name__)


def fleet_engine_id(url: str) -> int:
    """An engine's id in the shared state: 48 bits of a hash of its base URL (exact as
    a Lua number, and the same on every replica whatever order it learnt the engines in)."""
    digest = hashlib.blake2b(url.rstrip("/").encode(), digest_size=6).digest()
    return int.from_bytes(digest, "big")


class EngineIds:
    """This replica's worker ids <-> the fleet's engine ids."""

    def __init__(self) -> None:
        self.to_fleet: dict[int, int] = {}
        self.to_worker: dict[int, int] = {}

    def add(self, worker: int, url: str) -> int:
        fid = fleet_engine_id(url)
        self.to_fleet[worker] = fid
        self.to_worker[fid] = worker
        return fid

    def remove(self, worker: int) -> None:
        fid = self.to_fleet.pop(worker, None)
        if fid is not None and self.to_worker.get(fid) == worker:
            del self.to_worker[fid]


class ViewCapture(Router):
    """A router that hands each view to the router it wraps and keeps the last one: the
    shortlist is built from the view the decision was made on, without a second match.
    The plane calls `route` synchronously, so "the last view" is this request's."""

    def __init__(self, inner: Router) -> None:
        super().__init__()
        self.inner = inner
        # the wrapped router's name in the plane's messages, per instance
        self.name = getattr(inner, "name", None) or type(inner).__name__  # type: ignore[misc]
        self.last: View | None = None

    def route(self, request: RouteRequest, view: View) -> Decision:
        self.last = view
        return self.inner.route(request, view)

    def take(self) -> View | None:
        view, self.last = self.last, None
        return view

    def __getattr__(self, name: str) -> Any:  # the wrapped router's other attributes
        return getattr(self.inner, name)


@dataclass(slots=True)
class _Booking:
    booking_id: str
    key: EngineKey  # fleet id, rank
    prefill_tokens: int
    context_tokens: int
    prefilled: bool = False


@dataclass(frozen=True, slots=True)
class BookedRoute:
    """Where the request goes, and how many of its blocks the view says are there."""

    worker: int
    rank: int
    cached_blocks: int
    moved: bool  # not the router's choice
    shared: bool  # booked in Redis (False: this replica's local fallback)


# (seconds, "shared" | "fallback", the step that chose: `Booked.reason`, or "fallback")
OnBooked = Callable[[float, str, str], None]


class SharedRouting:
    """The booking step and the booked request's later moments, for one replica."""

    def __init__(
        self,
        state: RedisFleetState,
        store: SharedLoadStore,
        capture: ViewCapture,
        ids: EngineIds,
        *,
        block_size: int,
        policy: ShortlistPolicy | None = None,
        session_ttl_s: float = 600.0,
        spec_ttl_s: float = 10.0,
        on_booked: OnBooked | None = None,
    ) -> None:
        self.state = state
        self.store = store
        self.capture = capture
        self.ids = ids
        self.block_size = block_size
        self.policy = policy or ShortlistPolicy()
        self.session_ttl_s = session_ttl_s
        self.spec_ttl_s = spec_ttl_s
        self.on_booked = on_booked
        self._bookings: dict[int | str, _Booking] = {}  # by the plane's request id
        self.moved = 0  # bookings that took another candidate than the router's

    async def book(
        self, request: RouteRequest, worker: int, rank: int, *, cancellable: bool = True
    ) -> BookedRoute:
        """Book the request through the shared state; the router's choice (`worker`,
        `rank`) comes first in the shortlist. `cancellable=False`: the caller's task is
        cancelled only at shutdown (the native relay's), when this replica's whole share
        leaves Redis anyway, so the booking needs no shield."""
        view = self.capture.take()
        if view is not None:
            short = self._shortlist(request, view, worker, rank)
        else:  # a decision without a view (not with the plane): book it alone
            short = Shortlist([Candidate(EngineKey(worker, rank))], [0])
        to_fleet = self.ids.to_fleet
        cands: list[Candidate] = []
        cached: dict[EngineKey, int] = {}
        for c, b in zip(short.candidates, short.cached_blocks, strict=True):
            fid = to_fleet.get(c.engine.engine)
            if fid is not None:
                key = EngineKey(fid, c.engine.rank)
                cands.append(Candidate(key, c.ceiling, c.credit, b))
                cached[key] = b
        if not cands:  # the chosen worker left between the decision and now
            return BookedRoute(worker, rank, 0, False, False)
        self.release(request.request_id)  # a retry: the earlier attempt's booking goes
        started = time.perf_counter()
        bid, out = await self._book(request, short, cands, short.outside, cancellable)
        if isinstance(out, Booked) and out.index < 0 and not self._routable(out.engine, view):
            # an engine outside the shortlist this replica cannot send to (not one of
            # its workers, or not routable in its view): that booking goes, and the
            # request is booked again on the shortlist alone
            self.state.release_soon(bid)
            bid, out = await self._book(request, short, cands, None, cancellable)
        booked = out.engine
        assert booked is not None  # a booking always names an engine
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "booking %s: %s, shortlist %s (outside %s) -> %s, loads before %s",
                request.request_id,
                out.reason if isinstance(out, Booked) else "fallback",
                [
                    (c.engine.encode(), round(c.ceiling, 2), round(c.credit, 2), c.cached_blocks)
                    for c in cands
                ],
                short.outside,
                booked.encode(),
                [(x.in_flight, x.queued_prefill_tokens) for x in out.loads]
                if isinstance(out, Booked)
                else None,
            )
        key = booked
        shared = isinstance(out, Booked)
        if self.on_booked is not None:
            step = out.reason if isinstance(out, Booked) else "fallback"
            self.on_booked(time.perf_counter() - started, "shared" if shared else "fallback", step)
        if isinstance(out, Booked) and out.index < 0 and view is not None:
            cached[key] = self._held(key, view)
        if isinstance(out, Booked) and out.loads:
            self.store.apply_some(zip((c.engine for c in cands), out.loads, strict=True))
        booked_prefill = out.prefill_tokens
        self._bookings[request.request_id] = _Booking(
            bid, key, booked_prefill, request.prompt_tokens
        )
        self.store.own_booked(key, booked_prefill, request.prompt_tokens)
        booked_worker = self.ids.to_worker.get(key.engine, worker)
        moved = (booked_worker, key.rank) != (worker, rank)
        self.moved += moved
        return BookedRoute(booked_worker, key.rank, cached.get(key, 0), moved, shared)

    async def _book(
        self,
        request: RouteRequest,
        short: Shortlist,
        cands: list[Candidate],
        outside: OutsideTerms | None,
        cancellable: bool,
    ) -> tuple[str, Booked | LocalFallback]:
        """One booking of `request` in Redis: (its booking id, the outcome)."""
        bid = self.state.new_request_id()
        # the script books the prefill of the candidate it takes (the prompt beyond what
        # that engine holds or is computing of it), this one only if it cannot tell
        prefill = prefill_tokens(request.prompt_tokens, short.cached_blocks[0], self.block_size)
        booking = self.state.book(
            bid,
            cands,
            prefill_tokens=prefill,
            context_tokens=request.prompt_tokens,
            weights=self.policy.weights,
            session=request.session_id,
            session_ttl_s=self.session_ttl_s,
            anchors=anchors(request.content_keys),
            spec_ttl_s=self.spec_ttl_s,
            prompt_tokens=request.prompt_tokens,
            block_size=self.block_size,
            outside=outside,
        )
        if not cancellable:
            return bid, await booking
        task = asyncio.ensure_future(booking)
        try:
            # shielded: a client leaving mid-booking must not leave a booking that
            # this replica does not know of (it would stay in Redis until it leaves)
            return bid, await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._orphan(t, bid))
            raise

    def _routable(self, key: EngineKey, view: View | None) -> bool:
        """Whether this replica can send a request to the fleet's engine `key`: one of
        its workers, and a row of the view the router decided on."""
        worker = self.ids.to_worker.get(key.engine)
        if worker is None or view is None:
            return False
        try:
            view.position(worker, key.rank)
        except KeyError:
            return False
        return True

    def _held(self, key: EngineKey, view: View) -> int:
        """The request's blocks the view says the fleet's engine `key` holds or is
        computing (0 when it is not a row of the view)."""
        worker = self.ids.to_worker.get(key.engine)
        if worker is None:
            return 0
        try:
            row = view.position(worker, key.rank)
        except KeyError:
            return 0
        c = view.columns
        return int(max(c.local_blocks[row], c.pending_blocks[row]))

    def _shortlist(self, request: RouteRequest, view: View, worker: int, rank: int) -> Shortlist:
        """The router's own shortlist (`Router.shortlist`) in load units, or, when it
        gives none, the one derived from its decision and the view. A router's
        shortlist that breaks the contract is logged and replaced by the derived one:
        the request is still booked."""
        blocks = len(request.content_keys)
        policy = self.policy
        try:
            position = view.position(worker, rank)
        except KeyError:  # routed outside the columns it read: nothing to rank it by
            position = -1
        if position >= 0:
            router = self.capture.inner
            preferences = router.shortlist(request, view, position, policy.size)
            if preferences is not None:
                try:
                    check_preferences(preferences, len(view), position, policy.size)
                except ShortlistContractError as exc:
                    self.state.stats.bad_shortlists += 1
                    log.error(
                        "router %r gave a shortlist the booking cannot use (%s); "
                        "booking with the derived one",
                        self.capture.name,
                        exc,
                    )
                else:
                    return shortlist_of(
                        view,
                        preferences,
                        blocks,
                        request.prompt_tokens,
                        self.block_size,
                        policy.weights,
                    )
        return build_shortlist(view, worker, rank, blocks, policy)

    def _orphan(self, task: asyncio.Task[Booked | LocalFallback], bid: str) -> None:
        """A booking whose request was cancelled while it was in flight: release it."""
        if not task.cancelled() and task.exception() is None:
            self.state.release_soon(bid)

    # The request's later moments: this replica's view moves now; Redis hears of them
    # with this replica's next booking, or in one batch `settle_s` later (off the
    # request's path, and no round trip of their own under traffic). A non-streamed
    # answer's first byte comes with its end: its prefill-done is dropped from the queue
    # by its release, when both come within one batch.

    def prefill_done(self, request_id: int | str) -> None:
        b = self._bookings.get(request_id)
        if b is None or b.prefilled:
            return
        b.prefilled = True
        self.store.own_prefilled(b.key, b.prefill_tokens, b.context_tokens)
        self.state.prefill_done_soon(b.booking_id)

    def release(self, request_id: int | str) -> None:
        """The request holds its engine no more (idempotent)."""
        b = self._bookings.pop(request_id, None)
        if b is None:
            return
        self.store.own_released(b.key, b.prefill_tokens, b.context_tokens, b.prefilled)
        self.state.release_soon(b.booking_id)

    @property
    def in_flight(self) -> int:
        return len(self._bookings)

    @property
    def bad_shortlists(self) -> int:
        """Router shortlists replaced by the derived one (`StateStats.bad_shortlists`)."""
        return self.state.stats.bad_shortlists
