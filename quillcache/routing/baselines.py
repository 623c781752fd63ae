"""Cache-blind baselines: round-robin, random, least-loaded, power of two, session affinity."""

from __future__ import annotations

import bisect
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View, WorkerView


def load_key(w: WorkerView) -> tuple[int, int, int]:
    """Requests in flight first, then queued prefill tokens, then id (deterministic)."""
    return (w.in_flight, w.queued_prefill_tokens, w.worker)


#: `load_key`'s load fields, in order (the ordered structure's key for least-loaded).
LOAD_KEY_FIELDS = ("in_flight", "queued_prefill_tokens")


def least_loaded_at(view: View) -> int:
    """The position of the least loaded worker by `load_key`: the first row of the
    plane's load order when the view is prunable, else from the columns."""
    if view.prunable:
        return int(view.least_loaded(LOAD_KEY_FIELDS, 1)[0])
    c = view.columns
    at = np.flatnonzero(c.in_flight == c.in_flight.min())
    if len(at) > 1:
        queued = c.queued_prefill_tokens[at]
        at = at[queued == queued.min()]
    if len(at) > 1:
        return int(at[np.argmin(c.worker[at])])
    return int(at[0])


class RoundRobin(Router):
    name = "round-robin"
    summary = "cycle through the workers in id order"
    source = "classic; vLLM production-stack and Dynamo `--router-mode round-robin`"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._next = 0

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        at = self._next % len(view)
        self._next += 1
        return self.decide_at(request, view, at)


class RandomRouter(Router):
    name = "random"
    summary = "a uniformly random worker (seeded)"
    source = "Mooncake (FAST'25) baseline 'random'; Dynamo `--router-mode random`"

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        # as rng.choice(view.workers) draws: one index below the count
        return self.decide_at(request, view, self.rng.randrange(len(view)))


class LeastLoaded(Router):
    name = "least-loaded"
    prunes = True
    summary = "fewest requests in flight (then fewest queued prefill tokens)"
    source = "Mooncake (FAST'25) baseline 'load balancing'"

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        return self.decide_at(request, view, least_loaded_at(view))


class PowerOfTwo(Router):
    name = "power-of-two"
    summary = "two random workers, the less loaded one"
    source = "Mitzenmacher, 'The Power of Two Choices in Randomized Load Balancing' (2001)"

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        if len(view) == 1:
            return self.decide_at(request, view, 0)
        # the draws of rng.sample(view.workers, 2), as positions
        i, j = self.rng.sample(range(len(view)), 2)
        a, b = view.worker_at(i), view.worker_at(j)
        return self.decide(request, view, min(a, b, key=load_key))


class SessionAffinity(Router):
    """Consistent hashing (a ring with virtual nodes) on the session id; requests
    without one hash the chained key of their first `prefix_blocks` blocks, so
    requests sharing that prefix stick together (one shared system-prompt block does
    not send everything to one worker)."""

    name = "session-affinity"
    summary = "consistent hashing on the session id (else the first 4 blocks)"
    source = "Karger et al., consistent hashing (STOC'97); sticky sessions in every LB"

    def __init__(self, *, vnodes: int = 64, prefix_blocks: int = 4, **kw: Any) -> None:
        super().__init__(**kw)
        self.vnodes = vnodes
        self.prefix_blocks = max(prefix_blocks, 1)
        self._ring_for: tuple[tuple[int, int], ...] = ()
        # the id column the ring was last built for: the control plane hands out the
        # same read-only array while the fleet does not change, so most requests skip
        # building a 1,000-id tuple to find that out
        self._ring_ids: npt.NDArray[np.uint64] | None = None
        self._points: list[int] = []
        self._owners: list[tuple[int, int]] = []
        # rings of recent worker sets: a gateway shows each model's workers in turn
        self._rings: dict[tuple[tuple[int, int], ...], tuple[list[int], list[tuple[int, int]]]] = {}

    def _ring(self, rows: tuple[tuple[int, int], ...]) -> None:
        """The ring of `rows` ((worker, dp rank) pairs): each rank of a data-parallel
        engine is a node of its own."""
        if rows == self._ring_for:
            return
        cached = self._rings.get(rows)
        if cached is None:
            ring = sorted(
                (xxhash.xxh3_64_intdigest(_node_name(w, r, v).encode()), (w, r))
                for w, r in rows
                for v in range(self.vnodes)
            )
            cached = ([p for p, _ in ring], [o for _, o in ring])
            if len(self._rings) >= 32:
                self._rings.clear()
            self._rings[rows] = cached
        self._points, self._owners = cached
        self._ring_for = rows

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        c = view.columns
        ids = c.worker
        if ids is not self._ring_ids:
            self._ring(tuple(zip(ids.tolist(), c.dp_rank.tolist(), strict=True)))
            self._ring_ids = ids if not ids.flags.writeable else None
        if request.session_id is not None:
            h = xxhash.xxh3_64_intdigest(str(request.session_id).encode())
        elif len(request.content_keys):
            # a chained key names its whole prefix
            h = int(request.content_keys[min(len(request.content_keys), self.prefix_blocks) - 1])
        else:
            h = xxhash.xxh3_64_intdigest(str(request.request_id).encode())
        i = bisect.bisect_left(self._points, h) % len(self._points)
        return self.decide(request, view, view.by_id(*self._owners[i]))


def _node_name(worker: int, dp_rank: int, vnode: int) -> str:
    """A virtual node's name on the ring; rank 0 keeps the name a worker without data
    parallelism has, so adding ranks to one engine moves no other engine's keys."""
    return f"{worker}#{vnode}" if dp_rank == 0 else f"{worker}.{dp_rank}#{vnode}"
