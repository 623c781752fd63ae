"""`ControlPlane`: the one object the simulator and the online gateway both drive.

    cp = ControlPlane(index="native", router="quillcache", block_size=16)
    cp.add_worker(0, capacity_blocks=27_000)
    cp.ingest(0, [raw_msgpack_batch])          # engine KV events -> index.apply
    decision = cp.route(request, now_s=t)      # view (index.match + loads) -> router
    cp.prefill_done(request.request_id)        # optional, see "load accounting"
    cp.finish(request.request_id)

Load accounting: a driver that knows each worker's exact load (the simulator, or a
gateway scraping `/metrics`) calls `update_load`; one that does not creates the plane
with `track_load=True`, and then `route` / `prefill_done` / `finish` keep in-flight
requests, queued prefill tokens and running decodes per worker.

Speculative residency: between routing a request and its engine publishing
BlockStored, its prefix is *being computed* on the chosen worker. `route` records it
(when `speculative=True`); views report it as `WorkerView.pending_blocks` until
`prefill_done` / `finish` or `speculative_ttl_s`. The index itself is only ever
changed by events.

No asyncio, no sockets: the gateway wraps this object. It may ingest on one thread while
it routes on another: every use of the index goes through the plane's methods, which
hold a lock when the index does not serialise its own readers and writers
(`IndexBackend.thread_safe`); the rest of the plane belongs to the routing thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.errors import ConfigError, QuillCacheError
from quillcache.index import ApplyStats, IndexBackend, IndexStats, KeyArray, Match, create_backend
from quillcache.routing import Decision, Request, Router, View, WorkerView, create_router
from quillcache.routing.types import tier_of


class RouterContractError(QuillCacheError):
    """A router returned a worker that was not in the view it was given."""


class UnknownWorkerError(QuillCacheError, KeyError):
    """An operation named a worker the control plane does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(slots=True)
class WorkerState:
    """What the control plane knows about one worker besides its cache (in the index)."""

    worker: int
    capacity_blocks: int
    dp_ranks: int = 1
    draining: bool = False
    in_flight: int = 0
    queued_prefill_tokens: int = 0
    running_decodes: int = 0
    kv_usage: float = 0.0
    mean_context_tokens: float = 0.0
    resident_blocks: int = 0  # stored - removed, from ingested events (all media)
    # dp ranks whose events were lost beyond replay: until rebuilt, the index holds less
    # than the engine does, so what it says of this worker is a lower bound
    stale_ranks: set[int] = field(default_factory=set)


@dataclass(slots=True)
class _Tracked:
    worker: int
    keys: tuple[int, ...]
    prefill_tokens: int
    context_tokens: int
    expires_s: float
    prefilled: bool = False


@dataclass
class OpLatencies:
    """Wall-clock latency samples (ns) of index operations, for reports."""

    match_ns: list[int] = field(default_factory=list)
    apply_ns: list[int] = field(default_factory=list)


class ControlPlane:
    """Workers, event ingest into the index, and routing through a `Router`."""

    def __init__(
        self,
        *,
        index: IndexBackend | str = "native",
        router: Router | str = "quillcache",
        cost: CostModel | CostModelConfig | None = None,
        block_size: int | None = None,
        track_load: bool = False,
        speculative: bool = True,
        speculative_ttl_s: float = 60.0,
        router_options: dict[str, Any] | None = None,
        index_options: dict[str, Any] | None = None,
        order_only: bool = False,
    ) -> None:
        self.index: IndexBackend = (
            create_backend(index, **(index_options or {})) if isinstance(index, str) else index
        )
        self.router: Router = (
            create_router(router, **(router_options or {})) if isinstance(router, str) else router
        )
        self.cost = cost if isinstance(cost, CostModel) else CostModel(cost)
        self.block_size = block_size or self.cost.block_size
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {self.block_size}")
        self.track_load = track_load
        self.speculative = speculative
        self.speculative_ttl_s = speculative_ttl_s
        self.order_only = order_only  # tells routers there is no time (View.order_only)
        self.latencies = OpLatencies()
        self.apply_stats = ApplyStats()
        self._workers: dict[int, WorkerState] = {}
        self._tracked: dict[int | str, _Tracked] = {}
        # worker -> content key -> how many tracked requests are computing it
        self._pending: dict[int, dict[int, int]] = {}
        self._next_expiry_s = float("inf")
        self._tier_cache: dict[str, str] = {}
        # routable workers (not draining) by id; None: recompute on the next view
        self._routable: list[WorkerState] | None = None
        # The gateway ingests on one thread and routes on another: an index that does
        # not serialise its own readers and writers is used under this lock, by every
        # method here (nothing outside the plane touches the index).
        self._index_lock: contextlib.AbstractContextManager[Any] = (
            contextlib.nullcontext() if self.index.thread_safe else threading.Lock()
        )

    # --- workers ------------------------------------------------------------------

    def add_worker(
        self,
        worker: int,
        *,
        capacity_blocks: int | None = None,
        dp_ranks: int = 1,
        model: str = "",
        tokenizer: str = "",
    ) -> WorkerState:
        """Add (or re-add) a worker; registers each of its dp ranks with the index."""
        if dp_ranks < 1:
            raise ConfigError(f"dp_ranks must be >= 1, got {dp_ranks}")
        cap = (
            capacity_blocks
            if capacity_blocks is not None
            else self.cost.kv_capacity_blocks(self.block_size)
        )
        state = WorkerState(worker=worker, capacity_blocks=cap, dp_ranks=dp_ranks)
        self._workers[worker] = state
        self._routable = None
        self._pending.setdefault(worker, {})
        for rank in range(dp_ranks):
            with self._index_lock:
                self.index.register_source(worker, rank, model=model, tokenizer=tokenizer)
        return state

    def remove_worker(self, worker: int) -> int:
        """Forget a worker (dead or scaled in); returns the resident pairs dropped."""
        self._state(worker)
        del self._workers[worker]
        self._routable = None
        self._pending.pop(worker, None)
        for rid in [r for r, t in self._tracked.items() if t.worker == worker]:
            del self._tracked[rid]
        with self._index_lock:
            return self.index.remove_worker(worker)

    def set_draining(self, worker: int, draining: bool = True) -> None:
        """A draining worker keeps its cache and requests but gets no new ones."""
        self._state(worker).draining = draining
        self._routable = None

    def update_load(self, worker: int, **load: float) -> None:
        """Set load fields reported by the engine (in_flight, queued_prefill_tokens,
        running_decodes, kv_usage, mean_context_tokens)."""
        state = self._state(worker)
        for name, value in load.items():
            if name not in _LOAD_FIELDS:
                raise ConfigError(f"unknown load field {name!r}; known: {sorted(_LOAD_FIELDS)}")
            setattr(state, name, value)

    def workers(self) -> list[WorkerState]:
        return [self._workers[w] for w in sorted(self._workers)]

    def worker(self, worker: int) -> WorkerState:
        return self._state(worker)

    def _state(self, worker: int) -> WorkerState:
        try:
            return self._workers[worker]
        except KeyError:
            raise UnknownWorkerError(
                f"unknown worker {worker}; known: {sorted(self._workers)}"
            ) from None

    # --- events -------------------------------------------------------------------

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        *,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        """Apply raw msgpack event batches (vLLM wire format) from one source, in order;
        `seqs` (the engine's, one per batch) go to the index (`IndexBackend.apply`).

        Raises `EventDecodeError` for a bad batch, after applying the ones before it.
        """
        state = self._state(worker)
        t0 = time.perf_counter_ns()
        with self._index_lock:
            stats = self.index.apply(worker, payloads, dp_rank, seqs=seqs)
        self.latencies.apply_ns.append(time.perf_counter_ns() - t0)
        state.resident_blocks += stats.blocks_stored - stats.blocks_removed
        if stats.clears:
            state.resident_blocks = max(state.resident_blocks, 0)
        self.apply_stats += stats
        return stats

    def set_source_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        """Mark a source's residency unknown (events lost beyond replay) or known again.
        Routers see it as `WorkerView.residency_known`."""
        state = self._workers.get(worker)
        if state is None:  # removed while its events were being handled
            return
        ranks = state.stale_ranks
        if stale:
            ranks.add(dp_rank)
        else:
            ranks.discard(dp_rank)

    def clear(self, worker: int, dp_rank: int = 0) -> int:
        """The source dropped its cache without an event (restart seen by seq reset)."""
        state = self._state(worker)
        with self._index_lock:
            dropped = self.index.clear_source(worker, dp_rank)
        state.resident_blocks = max(state.resident_blocks - dropped, 0)
        return dropped

    # --- routing ------------------------------------------------------------------

    def view(
        self, request: Request, now_s: float = 0.0, only: AbstractSet[int] | None = None
    ) -> View:
        """What the router sees: routable workers, their load and their match. `only`
        restricts the candidates (e.g. the workers serving the request's model); None:
        every routable worker."""
        keys = request.content_keys
        per_worker: dict[int, dict[str, int]] = {}
        if len(keys):
            t0 = time.perf_counter_ns()
            with self._index_lock:
                matches = self.index.match(keys)
            self.latencies.match_ns.append(time.perf_counter_ns() - t0)
            for m in matches:
                media = per_worker.get(m.worker)
                if media is None:
                    per_worker[m.worker] = {m.medium: m.blocks}
                elif m.blocks > media.get(m.medium, 0):
                    media[m.medium] = m.blocks
        if self.speculative and now_s > self._next_expiry_s:
            self._expire(now_s)
        workers: list[WorkerView] = []
        key_list: list[int] | None = None
        tiers = self._tier_cache
        pending_of = self._pending
        routable = self._routable
        if routable is None:
            routable = self._routable = [
                self._workers[w] for w in sorted(self._workers) if not self._workers[w].draining
            ]
        if only is not None:
            routable = [s for s in routable if s.worker in only]
        for s in routable:
            wid = s.worker
            media = per_worker.get(wid)
            gpu = cpu = disk = 0
            if media is None:
                media = {}
            else:
                for medium, blocks in media.items():
                    tier = tiers.get(medium)
                    if tier is None:
                        tier = tiers[medium] = tier_of(medium)
                    if tier == "gpu":
                        gpu = max(gpu, blocks)
                    elif tier == "cpu":
                        cpu = max(cpu, blocks)
                    else:
                        disk = max(disk, blocks)
            pending = 0
            pend = pending_of.get(wid)
            if pend:
                if key_list is None:
                    key_list = keys.tolist()
                for k in key_list:
                    if k not in pend:
                        break
                    pending += 1
            workers.append(
                WorkerView(
                    wid,
                    s.in_flight,
                    s.queued_prefill_tokens,
                    s.running_decodes,
                    s.kv_usage,
                    s.capacity_blocks,
                    s.resident_blocks,
                    s.mean_context_tokens,
                    gpu,
                    cpu,
                    disk,
                    pending,
                    media,
                    not s.stale_ranks,
                )
            )
        return View(
            workers=workers,
            block_size=self.block_size,
            cost=self.cost,
            now_s=now_s,
            order_only=self.order_only,
        )

    def route(
        self, request: Request, now_s: float = 0.0, only: AbstractSet[int] | None = None
    ) -> Decision:
        """Route one request: build its view (restricted to `only`, see `view`), ask the
        router, record the decision. An empty candidate set is a rejection, whatever the
        router; a router choosing outside the view is a `RouterContractError`."""
        view = self.view(request, now_s, only)
        if only is not None and not view.workers:
            return Decision.reject("no routable worker among the candidates")
        decision = self.router.route(request, view)
        if decision.worker is not None:
            if decision.worker not in self._workers or (
                only is not None and decision.worker not in only
            ):
                raise RouterContractError(
                    f"router {self.router.name or type(self.router).__name__!r} chose worker "
                    f"{decision.worker}, which is not among the candidates it was shown"
                )
            self._track(request, decision, now_s)
        return decision

    def prefill_done(self, request_id: int | str) -> None:
        """The request's prompt is computed: its blocks are (or will shortly be) reported
        by events, so its speculative entry ends; with `track_load` it turns into a decode."""
        t = self._tracked.get(request_id)
        if t is None or t.prefilled:
            return
        t.prefilled = True
        self._unpend(t)
        if self.track_load and t.worker in self._workers:
            s = self._workers[t.worker]
            s.queued_prefill_tokens = max(s.queued_prefill_tokens - t.prefill_tokens, 0)
            s.mean_context_tokens = (
                s.mean_context_tokens * s.running_decodes + t.context_tokens
            ) / (s.running_decodes + 1)
            s.running_decodes += 1

    def finish(self, request_id: int | str) -> None:
        """The request is done (or failed): release everything tracked for it."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        if not t.prefilled:
            self._unpend(t)
        if self.track_load and t.worker in self._workers:
            s = self._workers[t.worker]
            s.in_flight = max(s.in_flight - 1, 0)
            if t.prefilled:
                s.running_decodes = max(s.running_decodes - 1, 0)
            else:
                s.queued_prefill_tokens = max(s.queued_prefill_tokens - t.prefill_tokens, 0)

    def _track(self, request: Request, decision: Decision, now_s: float) -> None:
        if not (self.track_load or self.speculative):
            return
        keys = tuple(request.content_keys.tolist()) if self.speculative else ()
        cached = 0
        for step in decision.plan:
            if step.action != "recompute":
                cached = max(cached, step.end)
        prefill_tokens = max(request.prompt_tokens - cached * self.block_size, 1)
        t = _Tracked(
            worker=decision.worker if decision.worker is not None else -1,
            keys=keys,
            prefill_tokens=prefill_tokens,
            context_tokens=request.prompt_tokens,
            expires_s=now_s + self.speculative_ttl_s,
        )
        old = self._tracked.get(request.request_id)
        if old is not None:  # a retried id: forget the earlier attempt
            self.finish(request.request_id)
        self._tracked[request.request_id] = t
        self._next_expiry_s = min(self._next_expiry_s, t.expires_s)
        if self.speculative:
            pend = self._pending.setdefault(t.worker, {})
            for k in keys:
                pend[k] = pend.get(k, 0) + 1
        if self.track_load:
            s = self._workers[t.worker]
            s.in_flight += 1
            s.queued_prefill_tokens += prefill_tokens

    def _unpend(self, t: _Tracked) -> None:
        pend = self._pending.get(t.worker)
        if not pend:
            return
        for k in t.keys:
            n = pend.get(k, 0) - 1
            if n > 0:
                pend[k] = n
            else:
                pend.pop(k, None)

    def _expire(self, now_s: float) -> None:
        # Speculative entries outlive a lost prefill_done call by at most the TTL.
        self._next_expiry_s = float("inf")
        for rid, t in list(self._tracked.items()):
            if not t.prefilled and t.expires_s >= now_s:
                self._next_expiry_s = min(self._next_expiry_s, t.expires_s)
            if not t.prefilled and t.expires_s < now_s:
                t.prefilled = True
                self._unpend(t)
                if not self.track_load:
                    del self._tracked[rid]

    # --- the index, for callers that only read it or pin --------------------------

    def match(self, keys: KeyArray) -> list[Match]:
        """The index's longest cached prefix of `keys` per source and medium."""
        with self._index_lock:
            return self.index.match(keys)

    def pin(self, keys: KeyArray) -> None:
        with self._index_lock:
            self.index.pin(keys)

    def unpin(self, keys: KeyArray) -> None:
        with self._index_lock:
            self.index.unpin(keys)

    def index_stats(self) -> IndexStats:
        with self._index_lock:
            return self.index.stats()

    def close(self) -> None:
        self.index.close()


_LOAD_FIELDS = frozenset(
    {"in_flight", "queued_prefill_tokens", "running_decodes", "kv_usage", "mean_context_tokens"}
)
