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

Data-parallel engines: a worker with several dp ranks is one routing row per rank
(each rank has its own KV cache and queue): views list the ranks, decisions name one
(`Decision.dp_rank`), load is booked on it and events land on it.

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
import math
import threading
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache._native import PendingPrefixes
from quillcache.controlplane.admission import admit
from quillcache.controlplane.explain import ExplainTotals
from quillcache.controlplane.explain import explain as _explain
from quillcache.controlplane.load import (
    DECODES,
    IN_FLIGHT,
    KV_USAGE,
    MEAN_CONTEXT,
    PAIRS,
    QUEUED,
    LoadStore,
    LocalLoadStore,
    load_column,
)
from quillcache.controlplane.order import LoadOrders, PlaneRowOrder
from quillcache.controlplane.pace import PaceConfig, PaceLearner
from quillcache.controlplane.pins import PinnedPrefixes
from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.errors import ConfigError, QuillCacheError
from quillcache.index import (
    ApplyStats,
    IndexBackend,
    IndexStats,
    KeyArray,
    Match,
    MatchColumns,
    create_backend,
)
from quillcache.index.inputs import as_key_array
from quillcache.routing import Decision, Request, Router, View, create_router, default_slo
from quillcache.routing.base import first_min
from quillcache.routing.types import FLEET_FIELDS, LOAD_FIELDS, WorkerColumns


class RouterContractError(QuillCacheError):
    """A router returned a worker that was not in the view it was given."""


class UnknownWorkerError(QuillCacheError, KeyError):
    """An operation named a worker the control plane does not know."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class UnknownSourceError(UnknownWorkerError):
    """An operation named a dp rank the worker was not added with."""


class WorkerState:
    """What the control plane knows about one worker besides its cache (in the index).
    Its load lives in the plane's `LoadStore` and its capacity, resident blocks and
    residency in the plane's fleet columns, one row per dp rank (`rows[rank]`): these
    properties read them, summed over the ranks (KV usage and the decodes' context:
    averaged)."""

    __slots__ = ("_fleet", "_load", "draining", "rows", "stale_ranks", "worker")

    def __init__(
        self, worker: int, rows: Sequence[int], load: LoadStore, fleet: _FleetColumns
    ) -> None:
        self.worker = worker
        self.rows = tuple(rows)
        self.draining = False
        # dp ranks whose events were lost beyond replay: until rebuilt, the index holds
        # less than the engine does, so what it says of this worker is a lower bound
        self.stale_ranks: set[int] = set()
        self._load = load
        self._fleet = fleet

    @property
    def dp_ranks(self) -> int:
        return len(self.rows)

    def _sum(self, column: int) -> float:
        if len(self.rows) == 1:
            return self._load.value(self.rows[0], column)
        return sum(self._load.value(r, column) for r in self.rows)

    @property
    def in_flight(self) -> float:
        return self._sum(IN_FLIGHT)

    @property
    def queued_prefill_tokens(self) -> float:
        return self._sum(QUEUED)

    @property
    def running_decodes(self) -> float:
        return self._sum(DECODES)

    @property
    def queued_prefill_pairs(self) -> float:
        return self._sum(PAIRS)

    @property
    def kv_usage(self) -> float:
        return self._sum(KV_USAGE) / len(self.rows)

    @property
    def mean_context_tokens(self) -> float:
        if len(self.rows) == 1:
            return self._load.value(self.rows[0], MEAN_CONTEXT)
        decodes = self.running_decodes
        if not decodes:
            return 0.0
        load = self._load
        return (
            sum(load.value(r, MEAN_CONTEXT) * load.value(r, DECODES) for r in self.rows) / decodes
        )

    def rank_state(self, dp_rank: int) -> dict[str, float]:
        """One rank's own figures: its load (`LOAD_FIELDS`), capacity and resident
        blocks."""
        row = self.rows[dp_rank]
        out = {name: self._load.value(row, i) for i, name in enumerate(LOAD_FIELDS)}
        out["capacity_blocks"] = float(self._fleet.m[row, CAPACITY])
        out["resident_blocks"] = float(self._fleet.m[row, RESIDENT])
        return out

    @property
    def capacity_blocks(self) -> int:
        """Summed over the ranks (`add_worker` takes it per rank)."""
        return int(sum(self._fleet.m[r, CAPACITY] for r in self.rows))

    @property
    def resident_blocks(self) -> int:
        """Stored - removed, from ingested events (all media, all ranks)."""
        return int(sum(self._fleet.m[r, RESIDENT] for r in self.rows))

    @property
    def max_num_seqs(self) -> int:
        """The engine's sequence slots per rank, when configured (0: the cost model's)."""
        return int(self._fleet.m[self.rows[0], SLOTS])

    @property
    def stored_blocks(self) -> int:
        """Blocks the engine reported stored since it was added (all ranks, all media)."""
        return int(sum(self._fleet.stored[r] for r in self.rows))

    def __repr__(self) -> str:
        return (
            f"WorkerState(worker={self.worker}, in_flight={self.in_flight}, "
            f"queued_prefill_tokens={self.queued_prefill_tokens}, "
            f"running_decodes={self.running_decodes}, draining={self.draining})"
        )


CAPACITY, RESIDENT, KNOWN, PACE, SLOTS = range(len(FLEET_FIELDS))


class _FleetColumns:
    """The plane's own per-worker columns (FLEET_FIELDS), one row per worker slot."""

    def __init__(self, rows: int = 64) -> None:
        self.m = np.zeros((rows, len(FLEET_FIELDS)), dtype=np.float64)
        # blocks each row's engine stored (BlockStored), cumulative: each takes a free
        # block, the LRU's oldest once the cache is full, so this is how fast its cache
        # turns over (the retention policy's pressure); not a routing column
        self.stored = np.zeros(rows, dtype=np.float64)

    def add(self, row: int, capacity_blocks: int, max_num_seqs: int = 0) -> None:
        if row >= len(self.m):
            size = max(row + 1, 2 * len(self.m))
            grown = np.zeros((size, len(FLEET_FIELDS)))
            grown[: len(self.m)] = self.m
            self.m = grown
            stored = np.zeros(size)
            stored[: len(self.stored)] = self.stored
            self.stored = stored
        self.m[row] = (capacity_blocks, 0.0, 1.0, 1.0, max_num_seqs)
        self.stored[row] = 0.0

    def slotted(self) -> bool:
        """Whether some row has sequence slots of its own (`max_num_seqs`)."""
        return bool((self.m[:, SLOTS] > 0).any())


@dataclass(slots=True)
class _Candidates:
    """The routable workers (or a subset) in id order: their ids, their rows, and each
    worker id's position among them."""

    ids: npt.NDArray[np.uint64]  # per position (a worker's ranks: consecutive positions)
    ranks: npt.NDArray[np.int64]  # the dp rank of each position
    rows: npt.NDArray[np.intp] | slice
    # position of each worker id's rank 0 (-1: not a candidate), when ids are small
    # enough for a table
    table: npt.NDArray[np.intp] | None
    # position by plane row (-1: not a candidate)
    row_position: npt.NDArray[np.intp]
    # per position, how many ranks its worker has; None: every worker has one
    rank_counts: npt.NDArray[np.intp] | None

    def positions(self, workers: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
        """Each worker's (rank 0) position among the candidates, -1 for the others."""
        if self.table is not None:
            inside = workers < len(self.table)  # compared as u64: ids up to 2**64-1
            if inside.all():
                return self.table[workers.astype(np.intp)]
            out = np.full(len(workers), -1, dtype=np.intp)
            out[inside] = self.table[workers[inside].astype(np.intp)]
            return out
        if not len(self.ids):
            return np.full(len(workers), -1, dtype=np.intp)
        at = np.minimum(np.searchsorted(self.ids, workers, side="left"), len(self.ids) - 1)
        return np.where(self.ids[at] == workers, at, -1)

    def rank_positions(
        self, workers: npt.NDArray[np.uint64], ranks: npt.NDArray[np.uint32]
    ) -> npt.NDArray[np.intp]:
        """Each (worker, rank)'s position, -1 for the others."""
        at = self.positions(workers)
        if self.rank_counts is None:
            return np.where(ranks == 0, at, -1)
        ok = (at >= 0) & (ranks < self.rank_counts[np.maximum(at, 0)])
        return np.where(ok, at + ranks.astype(np.intp), -1)

    def position_list(self, workers: list[int], ranks: list[int]) -> list[int]:
        """`rank_positions` of a few (worker, rank) pairs, in Python (numpy's per-call
        overhead is more than the lookups)."""
        table = self.table
        if table is None:
            at = self.rank_positions(
                np.asarray(workers, dtype=np.uint64), np.asarray(ranks, dtype=np.uint32)
            )
            return [int(p) for p in at.tolist()]
        counts = self.rank_counts
        out = []
        for w, r in zip(workers, ranks, strict=True):
            p = int(table[w]) if w < len(table) else -1
            if p >= 0 and r:
                p = p + r if counts is not None and r < counts[p] else -1
            out.append(p)
        return out

    @classmethod
    def of(cls, states: list[WorkerState], row_capacity: int) -> _Candidates:
        """The candidates made of `states` (in id order): one position per rank."""
        ids = [s.worker for s in states for _ in s.rows]
        rows = [r for s in states for r in s.rows]
        ids_a = np.asarray(ids, dtype=np.uint64)
        ids_a.flags.writeable = False  # shared by every view of this candidate set
        ranks = np.asarray([k for s in states for k in range(len(s.rows))], dtype=np.int64)
        ranks.flags.writeable = False
        rows_a = np.asarray(rows, dtype=np.intp)
        contiguous = bool(len(rows_a)) and bool((rows_a == np.arange(len(rows_a))).all())
        row_position = np.full(max(row_capacity, 1), -1, dtype=np.intp)
        row_position[rows_a] = np.arange(len(rows_a))
        first = np.flatnonzero(ranks == 0)
        table = None
        if len(ids_a) and ids_a[-1] < _MAX_TABLE:
            table = np.full(int(ids_a[-1]) + 1, -1, dtype=np.intp)
            table[ids_a[first]] = first
        rank_counts = None
        if len(rows_a) != len(states):
            rank_counts = np.asarray([len(s.rows) for s in states for _ in s.rows], dtype=np.intp)
        return cls(
            ids_a,
            ranks,
            slice(0, len(rows_a)) if contiguous else rows_a,
            table,
            row_position,
            rank_counts,
        )


_LOAD_COLUMN = {name: i for i, name in enumerate(LOAD_FIELDS)}
_NO_KEYS: npt.NDArray[np.uint64] = np.zeros(0, dtype=np.uint64)
_NO_POSITIONS: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)

#: Candidate subsets (`route(only=...)`) kept per routable set.
_MAX_SUBSETS = 64

#: Worker ids below this get a position table; larger ids are searched.
_MAX_TABLE = 1 << 20


@dataclass(slots=True)
class _Tracked:
    worker: int
    row: int  # the plane row of the chosen (worker, dp rank)
    keys: npt.NDArray[np.uint64]  # empty when not speculating
    prefill_tokens: int
    context_tokens: int  # its prompt: the context it decodes with
    expires_s: float
    prefilled: bool = False
    routed_s: float = 0.0  # the `now_s` it was routed at
    # its row's load when it was routed (LOAD_FIELDS order; None: moved, teaches nothing)
    load_at_route: list[float] | None = None
    output_tokens: int = 0  # the request's expected output (a slot frees after that many)
    pending: bool = False  # its keys count as being computed on its row (`_pending`)


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
        load_store: LoadStore | None = None,
        latencies: OpLatencies | None = None,
        prune_min_rows: int | None = 64,
        explain: bool = False,
        pace: PaceConfig | None = None,
        speculate_when_booked: bool = False,
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
        # Several gateways on shared state: the booking step may move a request to
        # another candidate, so its prefix counts as being computed only once `booked`
        # names where it went; counted on the router's choice at once, requests routed
        # while the booking is in flight saw it there, followed it, and started the
        # prefix on a second engine.
        self.speculate_when_booked = speculate_when_booked
        self.order_only = order_only  # tells routers there is no time (View.order_only)
        # Where match and apply latencies are recorded, every sample kept (a replay's
        # report); None (a long-lived gateway) records none: the lists would grow with
        # every request.
        self.latencies = latencies
        self.apply_stats = ApplyStats()
        self.load: LoadStore = load_store if load_store is not None else LocalLoadStore()
        # Views of at least this many rows are prunable (`View.prunable`): routers that
        # can score only the rows that may win do so. None: never (every view is scored
        # whole, the reference the conformance tests compare pruning against).
        if prune_min_rows is not None and prune_min_rows < 1:
            raise ConfigError(f"prune_min_rows must be >= 1 or None, got {prune_min_rows}")
        self.prune_min_rows = prune_min_rows
        # True: every decision carries its `Explanation` (`route(explain=...)` per call)
        # and `explain_totals` sums them; off, routing pays nothing for it
        self.explain = explain
        self.explain_totals = ExplainTotals()
        # pinned prefixes: their holders with room are preferred (`pin`, `pins.py`)
        self.pinned = PinnedPrefixes()
        self._orders = LoadOrders(self.load)
        self._fleet = _FleetColumns()
        self._slotted = False  # some row has its own max_num_seqs (`WorkerColumns.slotted`)
        # which engines turn out slower than the rest (`pace.py`), from the observed
        # TTFT `prefill_done(now_s=...)` reports; the routers that price time read it
        self.pace = PaceLearner(self._set_pace, pace)
        self._timed = False  # a `prefill_done` came with its time: keep what pace needs
        self._workers: dict[int, WorkerState] = {}
        self._free_rows: list[int] = []  # rows of removed workers, reused first
        self._next_row = 0
        self._tracked: dict[int | str, _Tracked] = {}
        # plane row -> content key -> how many tracked requests are computing it
        self._pending = PendingPrefixes()
        self._next_expiry_s = float("inf")
        # routable workers (not draining) by id; None: recompute on the next view
        self._routable: _Candidates | None = None
        self._subsets: dict[frozenset[int], _Candidates] = {}  # `only` sets seen
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
        max_num_seqs: int | None = None,
    ) -> WorkerState:
        """Add (or re-add) a worker; registers each of its dp ranks with the index.
        `capacity_blocks` is per rank (each rank has a KV cache of its own), and so is
        `max_num_seqs` (its sequence slots; None: the cost model's)."""
        if dp_ranks < 1:
            raise ConfigError(f"dp_ranks must be >= 1, got {dp_ranks}")
        if max_num_seqs is not None and max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        cap = (
            capacity_blocks
            if capacity_blocks is not None
            else self.cost.kv_capacity_blocks(self.block_size)
        )
        old = self._workers.get(worker)
        rows = list(old.rows[:dp_ranks]) if old is not None else []
        if old is not None and len(old.rows) > dp_ranks:  # fewer ranks than before
            self._free(old.rows[dp_ranks:])
        while len(rows) < dp_ranks:
            if self._free_rows:
                rows.append(self._free_rows.pop())
            else:
                rows.append(self._next_row)
                self._next_row += 1
        state = WorkerState(worker, rows, self.load, self._fleet)
        self._orders.assign(rows, worker)
        for row in rows:
            self.load.add(row)
            self._fleet.add(row, cap, max_num_seqs or 0)
        self._slotted = self._fleet.slotted()
        self._workers[worker] = state
        self._routable = None
        for rank in range(dp_ranks):
            with self._index_lock:
                self.index.register_source(worker, rank, model=model, tokenizer=tokenizer)
        return state

    def remove_worker(self, worker: int) -> int:
        """Forget a worker (dead or scaled in); returns the resident pairs dropped."""
        state = self._state(worker)
        del self._workers[worker]
        self._free(state.rows)
        self._routable = None
        with self._index_lock:
            return self.index.remove_worker(worker)

    def _free(self, rows: Sequence[int]) -> None:
        """Give rows back; what was tracked on them is forgotten (their load with them),
        or a later release would land on the row's next owner."""
        freed = set(rows)
        self._orders.release(rows)
        for rid in [r for r, t in self._tracked.items() if t.row in freed]:
            del self._tracked[rid]
        for row in rows:
            self._pending.remove_worker(row)
            self.pace.forget(row)
            self._fleet.m[row, SLOTS] = 0.0
            self._free_rows.append(row)
        self._slotted = self._fleet.slotted()
        self._free_rows.sort(reverse=True)  # lowest row first: rows stay in id order

    def set_draining(self, worker: int, draining: bool = True) -> None:
        """A draining worker keeps its cache and requests but gets no new ones."""
        self._state(worker).draining = draining
        self._routable = None

    def update_load(self, worker: int, **load: float) -> None:
        """Set load fields reported by the engine (in_flight, queued_prefill_tokens,
        running_decodes, kv_usage, mean_context_tokens) for the whole engine. With
        several dp ranks, a count's change from the ranks' sum is spread evenly over
        them (what each was booked is kept) and KV usage and mean context apply to
        every rank; `update_rank_load` sets one rank's."""
        state = self._state(worker)
        columns: dict[int, float] = {}
        for name, value in load.items():
            column = _LOAD_COLUMN.get(name)
            if column is None:
                column = load_column(name)  # raises, naming the known fields
            # `0 <= value < inf` is False for NaN too: the checking path names it
            columns[column] = float(value) if 0.0 <= value < math.inf else _load_value(name, value)
        if len(state.rows) == 1:
            self.load.report(state.rows[0], columns)
            return
        per_row: list[dict[int, float]] = [{} for _ in state.rows]
        for column, value in columns.items():
            if column not in (IN_FLIGHT, QUEUED, DECODES, PAIRS):
                for values in per_row:
                    values[column] = value
                continue
            now = [self.load.value(row, column) for row in state.rows]
            step = (value - sum(now)) / len(now)
            spread = [v + step for v in now]
            if min(spread) < 0:  # cannot keep the shape: an even split
                spread = [value / len(now)] * len(now)
            for values, v in zip(per_row, spread, strict=True):
                values[column] = v
        for row, values in zip(state.rows, per_row, strict=True):
            self.load.report(row, values)

    def update_rank_load(self, worker: int, dp_rank: int, **load: float) -> None:
        """`update_load` for one dp rank of the worker."""
        row = self._rank_row(self._state(worker), dp_rank)
        self.load.report(
            row, {load_column(name): _load_value(name, value) for name, value in load.items()}
        )

    def _rank_row(self, state: WorkerState, dp_rank: int) -> int:
        if not 0 <= dp_rank < len(state.rows):
            raise UnknownSourceError(
                f"worker {state.worker} has dp ranks 0..{len(state.rows) - 1}, not {dp_rank}"
            )
        return state.rows[dp_rank]

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
        # Called once per engine batch (a fleet's upkeep): no work that is not needed.
        state = self._workers.get(worker)
        if state is None:
            state = self._state(worker)  # raises, naming the known workers
        rows = state.rows
        row = rows[dp_rank] if 0 <= dp_rank < len(rows) else self._rank_row(state, dp_rank)
        latencies = self.latencies
        if latencies is None:
            with self._index_lock:
                stats = self.index.apply(worker, payloads, dp_rank, seqs=seqs)
        else:
            t0 = time.perf_counter_ns()
            with self._index_lock:
                stats = self.index.apply(worker, payloads, dp_rank, seqs=seqs)
            latencies.apply_ns.append(time.perf_counter_ns() - t0)
        stored = stats.blocks_stored
        change = stored - stats.blocks_removed
        fleet = self._fleet.m
        if change:
            fleet[row, RESIDENT] += change
        if stored:
            self._fleet.stored[row] += stored
        if stats.clears:
            fleet[row, RESIDENT] = max(fleet[row, RESIDENT], 0.0)
        self.apply_stats += stats
        return stats

    def set_source_stale(self, worker: int, dp_rank: int, stale: bool) -> None:
        """Mark a source's residency unknown (events lost beyond replay) or known again.
        Routers see it as `WorkerView.residency_known`."""
        state = self._workers.get(worker)
        if state is None:  # removed while its events were being handled
            return
        if not 0 <= dp_rank < len(state.rows):  # re-added with fewer ranks meanwhile
            return
        row = state.rows[dp_rank]
        if stale:
            state.stale_ranks.add(dp_rank)
        else:
            state.stale_ranks.discard(dp_rank)
        self._fleet.m[row, KNOWN] = 0.0 if stale else 1.0

    def clear(self, worker: int, dp_rank: int = 0) -> int:
        """The source dropped its cache without an event (restart seen by seq reset)."""
        row = self._rank_row(self._state(worker), dp_rank)
        with self._index_lock:
            dropped = self.index.clear_source(worker, dp_rank)
        fleet = self._fleet.m
        fleet[row, RESIDENT] = max(fleet[row, RESIDENT] - dropped, 0.0)
        return dropped

    def clear_medium(self, worker: int, medium: str) -> int:
        """Every rank of `worker` dropped its residency in `medium` without an event (an
        offload tier cleared: LMCache's `/clear`); returns the pairs dropped."""
        state = self._state(worker)
        fleet = self._fleet.m
        dropped = 0
        for rank, row in enumerate(state.rows):
            with self._index_lock:
                gone = self.index.clear_medium(worker, rank, medium)
            fleet[row, RESIDENT] = max(fleet[row, RESIDENT] - gone, 0.0)
            dropped += gone
        return dropped

    # --- routing ------------------------------------------------------------------

    def view(
        self, request: Request, now_s: float = 0.0, only: AbstractSet[int] | None = None
    ) -> View:
        """What the router sees: routable workers, their load and their match, as
        columns (`View.columns`). `only` restricts the candidates (e.g. the workers
        serving the request's model); None: every routable worker."""
        if self.speculative and now_s > self._next_expiry_s:
            self._expire(now_s)
        cand = self._candidates(only)
        n = len(cand.ids)
        keys = request.content_keys
        hits: MatchColumns | None = None
        if not len(keys):
            tiers = np.zeros((3, n), dtype=np.int64)
        else:
            t0 = time.perf_counter_ns() if self.latencies is not None else 0
            # the index places the hits itself, ranks included, when the ids are small
            # enough for a position table
            table = cand.table
            with self._index_lock:
                if table is not None:
                    # every candidate is a registered worker's rank: a live source
                    tiers, hits = self.index.match_tiers(
                        keys, table, n, cand.rank_counts, all_live=True
                    )
                else:
                    hits = self.index.match_columns(keys)
            if self.latencies is not None:
                self.latencies.match_ns.append(time.perf_counter_ns() - t0)
            if table is None:
                tiers = hits.tiers_at(cand.rank_positions(hits.worker, hits.dp_rank), n)
        pending = np.zeros(n, dtype=np.int64)
        pending_at = _NO_POSITIONS
        if len(self._pending) and len(keys):
            rows, blocks = self._pending.prefixes(as_key_array(keys))
            at = cand.row_position[rows.astype(np.intp)]
            ok = at >= 0
            pending[at[ok]] = blocks[ok]
            pending_at = at[ok & (blocks > 0)]
        # The load and fleet rows may be views of the plane's own matrices (and the ids
        # are shared by every view): read-only, so a router cannot change the plane.
        load = self.load.rows(cand.rows)
        load.flags.writeable = False
        fleet = self._fleet.m[cand.rows]
        fleet.flags.writeable = False
        columns = WorkerColumns(
            cand.ids,
            load,
            fleet,
            tiers[0],
            tiers[1],
            tiers[2],
            pending,
            cand.ranks,
            self.pace.paced,
            self._slotted,
        )
        order = None
        if self.prune_min_rows is not None and n >= self.prune_min_rows:
            order = PlaneRowOrder(self._orders, cand, hits, pending_at)
        return View(
            None,
            self.block_size,
            self.cost,
            now_s,
            self.order_only,
            columns=columns,
            media_of=_MediaOf(hits)
            if hits is not None and (len(hits.worker) or hits.floors)
            else None,
            order=order,
        )

    def _candidates(self, only: AbstractSet[int] | None) -> _Candidates:
        routable = self._routable
        if routable is None:
            ids = sorted(w for w, s in self._workers.items() if not s.draining)
            routable = self._routable = _Candidates.of(
                [self._workers[w] for w in ids], self._next_row
            )
            self._subsets.clear()
        if only is None:
            return routable
        # A gateway names the same few subsets (the workers serving each model) again
        # and again: each is built once per routable set.
        key = only if isinstance(only, frozenset) else None
        subset = self._subsets.get(key) if key is not None else None
        if subset is None:
            ids = sorted(w for w in only if w in self._workers and not self._workers[w].draining)
            subset = _Candidates.of([self._workers[w] for w in ids], self._next_row)
            if key is not None:
                if len(self._subsets) >= _MAX_SUBSETS:
                    self._subsets.clear()
                self._subsets[key] = subset
        return subset

    def route(
        self,
        request: Request,
        now_s: float = 0.0,
        only: AbstractSet[int] | None = None,
        *,
        explain: bool | None = None,
        candidates: bool = False,
    ) -> Decision:
        """Route one request: build its view (restricted to `only`, see `view`), ask the
        router, record the decision. An empty candidate set is a rejection, whatever the
        router; a router choosing outside the view is a `RouterContractError`.

        `explain` (None: the plane's `explain`) attaches the decision's `Explanation`
        (`controlplane/explain.py`) and adds it to `explain_totals`; `candidates` lists
        the rows it compared (a sampled log's detail, bounded)."""
        if len(self.pinned):
            only = self._pinned_only(request, only)
        view = self.view(request, now_s, only)
        if only is not None and not len(view):
            return Decision.reject("no routable worker among the candidates")
        decision = self._route(request, view, now_s, only)
        if self.explain if explain is None else explain:
            why = _explain(request, view, decision, candidates=candidates)
            self.explain_totals.add(why)
            decision = Decision(
                decision.worker,
                decision.plan,
                decision.estimate,
                decision.reason,
                decision.dp_rank,
                why,
            )
        return decision

    def _route(
        self, request: Request, view: View, now_s: float, only: AbstractSet[int] | None
    ) -> Decision:
        decision = self.router.route(request, view)
        if decision.worker is not None:
            state = self._workers.get(decision.worker)
            if (
                state is None
                or state.draining
                or (only is not None and decision.worker not in only)
            ):
                raise RouterContractError(
                    f"router {self.router.name or type(self.router).__name__!r} chose worker "
                    f"{decision.worker}, which is not among the candidates it was shown"
                )
            rank = decision.dp_rank
            if rank is None:
                rank = _best_rank(view, state)
                decision = replace(decision, dp_rank=rank)
            elif not 0 <= rank < len(state.rows):
                raise RouterContractError(
                    f"router {self.router.name or type(self.router).__name__!r} chose dp rank "
                    f"{rank} of worker {decision.worker}, which has {len(state.rows)}"
                )
            decision = admit(request, view, decision, default_slo(self.router))
            if decision.rejected:
                return decision
            self._track(request, decision, state.rows[rank], now_s)
        return decision

    def move(self, request_id: int | str, worker: int, dp_rank: int = 0) -> None:
        """A routed request goes to another worker (and rank) than its decision named:
        a booking step that took another candidate (several gateways on shared state),
        or a retry elsewhere. What was tracked for it moves along: its blocks being
        computed (so the next views see them where they really are) and, with
        `track_load`, its booked load. A request not tracked (finished, or never
        tracked) is left alone; an unknown worker or rank is an `UnknownWorkerError`."""
        row = self._rank_row(self._state(worker), dp_rank)
        t = self._tracked.get(request_id)
        if t is None or t.row == row:
            return
        was_pending = t.pending
        self._unpend(t)
        if self.track_load and t.worker in self._workers:
            self.load.release(t.row, t.prefill_tokens, t.context_tokens, t.prefilled)
        t.worker, t.row = worker, row
        t.load_at_route = None  # the other row's load: teaches nothing about this one
        if was_pending and not t.prefilled:
            self._pend(t)
        if self.track_load:
            self.load.book(row, t.prefill_tokens, t.context_tokens)
            if t.prefilled:
                self.load.prefilled(row, t.prefill_tokens, t.context_tokens)

    def booked(self, request_id: int | str, worker: int, dp_rank: int = 0) -> None:
        """Where the booking step of several gateways placed a routed request: `move`d
        there when it is not the decision's worker, and with `speculate_when_booked`
        its prefix counts as being computed there from now on."""
        self.move(request_id, worker, dp_rank)
        t = self._tracked.get(request_id)
        if t is not None and not t.prefilled and not t.pending:
            self._pend(t)

    def prefill_done(self, request_id: int | str, now_s: float | None = None) -> None:
        """The request's prompt is computed: its blocks are (or will shortly be) reported
        by events, so its speculative entry ends; with `track_load` it turns into a decode.
        `now_s` (the clock `route` was given): when its first token came, which teaches
        the plane how fast its engine is against the estimate (`pace.py`)."""
        t = self._tracked.get(request_id)
        if t is None or t.prefilled:
            return
        if now_s is not None:
            self._timed = True
            if t.load_at_route is not None and t.worker in self._workers:
                self.pace.observe(t.row, now_s - t.routed_s, self._expected_ttft_s(t))
        t.prefilled = True
        self._unpend(t)
        if self.track_load and t.worker in self._workers:
            self.load.prefilled(t.row, t.prefill_tokens, t.context_tokens)

    def finish(self, request_id: int | str) -> None:
        """The request is done (or failed): release everything tracked for it."""
        t = self._tracked.pop(request_id, None)
        if t is None:
            return
        if not t.prefilled:
            self._unpend(t)
        if self.track_load and t.worker in self._workers:
            self.load.release(t.row, t.prefill_tokens, t.context_tokens, t.prefilled)

    def _track(self, request: Request, decision: Decision, row: int, now_s: float) -> None:
        if not (self.track_load or self.speculative):
            return
        keys = as_key_array(request.content_keys) if self.speculative else _NO_KEYS
        cached = 0
        for step in decision.plan:
            if step.action != "recompute":
                cached = max(cached, step.end)
        prefill_tokens = max(request.prompt_tokens - cached * self.block_size, 1)
        t = _Tracked(
            worker=decision.worker if decision.worker is not None else -1,
            row=row,
            keys=keys,
            prefill_tokens=prefill_tokens,
            context_tokens=request.prompt_tokens,
            expires_s=now_s + self.speculative_ttl_s,
            routed_s=now_s,
            # what the pace is learned against, kept once the caller reports times
            load_at_route=self.load.rows(slice(row, row + 1))[0].tolist() if self._timed else None,
            output_tokens=request.expected_output_tokens,
        )
        old = self._tracked.get(request.request_id)
        if old is not None:  # a retried id: forget the earlier attempt
            self.finish(request.request_id)
        self._tracked[request.request_id] = t
        self._next_expiry_s = min(self._next_expiry_s, t.expires_s)
        if self.speculative and not self.speculate_when_booked:
            self._pend(t)
        if self.track_load:
            self.load.book(row, prefill_tokens, request.prompt_tokens)

    def _expected_ttft_s(self, t: _Tracked) -> float:
        """The TTFT the cost model expects of a request at the fleet's speed, from its
        row's load when it was routed: its queue and prefill sharing steps with the
        running decodes, and the wait for a sequence slot when all were taken (what a
        busy engine adds to every request there, which a pace must not be blamed for)."""
        assert t.load_at_route is not None
        in_flight, queued, decodes, _, mean_context, pairs = t.load_at_route
        cost = self.cost
        return cost.loaded_prefill_time(
            queued_tokens=queued,
            queued_pairs=pairs,
            new_tokens=t.prefill_tokens,
            context_tokens=t.context_tokens - t.prefill_tokens,
            running_decodes=decodes,
            mean_context_tokens=mean_context,
        ) + cost.slot_wait_time(
            in_flight, decodes, mean_context, t.output_tokens, float(self._fleet.m[t.row, SLOTS])
        )

    def _set_pace(self, row: int, pace: float) -> None:
        self._fleet.m[row, PACE] = pace

    def _pend(self, t: _Tracked) -> None:
        if len(t.keys):
            self._pending.add(t.row, t.keys)
            t.pending = True

    def _unpend(self, t: _Tracked) -> None:
        if t.pending:
            self._pending.remove(t.row, t.keys)
            t.pending = False

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

    def pin(self, keys: KeyArray, engine: int | None = None) -> None:
        """Keep the prefix's index nodes and prefer its holders (its bound `engine`, when
        given) for requests starting with it (`pins.PinnedPrefixes`), until as many
        `unpin` calls."""
        keys = as_key_array(keys)
        with self._index_lock:
            self.index.pin(keys)
        self.pinned.add(keys, engine)

    def unpin(self, keys: KeyArray) -> None:
        keys = as_key_array(keys)
        with self._index_lock:
            self.index.unpin(keys)
        self.pinned.remove(keys)

    def holders(self, keys: KeyArray, medium: str = "GPU") -> set[int]:
        """The workers holding all of `keys` in `medium` (on any dp rank)."""
        n = len(keys)
        return {m.worker for m in self.match(keys) if m.medium == medium and m.blocks >= n}

    def computing(self, keys: KeyArray) -> set[int]:
        """The workers on which a routed request is computing all of `keys` right now
        (speculative residency: routed, not yet prefilled)."""
        n = len(keys)
        if not n or not len(self._pending):
            return set()
        rows, blocks = self._pending.prefixes(as_key_array(keys))
        busy = {int(r) for r, b in zip(rows.tolist(), blocks.tolist(), strict=True) if b >= n}
        if not busy:
            return set()
        return {w for w, state in self._workers.items() if busy.intersection(state.rows)}

    def queue_wait_s(self, worker: int) -> float:
        """The worker's estimated queue wait: its queued prefill at the cost model's
        speed (booked and reported load); infinite for a worker not (or no longer)
        added."""
        state = self._workers.get(worker)
        if state is None:
            return math.inf
        return self.cost.queue_time(state.queued_prefill_tokens, state.queued_prefill_pairs)

    def _pinned_only(
        self, request: Request, only: AbstractSet[int] | None
    ) -> AbstractSet[int] | None:
        """`only` narrowed to the holders with room of a pinned prefix the request starts
        with (the pin stage, `pins.py`); unchanged when there is none."""
        prefer = self.pinned.prefer(
            as_key_array(request.content_keys), self.holders, self.queue_wait_s
        )
        if prefer is None:
            return only
        narrowed = prefer if only is None else prefer & only
        states = self._workers
        routable = frozenset(w for w in narrowed if w in states and not states[w].draining)
        return routable or only

    def index_stats(self) -> IndexStats:
        with self._index_lock:
            return self.index.stats()

    def close(self) -> None:
        self.index.close()


def _load_value(name: str, value: float) -> float:
    """A reported load figure: finite and at least 0 (routers that prune rely on it:
    a negative queue or decode count would score below the bound that lets them skip
    rows), else ConfigError naming it."""
    if not math.isfinite(value) or value < 0:
        raise ConfigError(f"load field {name!r} must be a finite number >= 0, got {value!r}")
    return float(value)


def _best_rank(view: View, state: WorkerState) -> int:
    """The rank of `state` a decision without one goes to: the longest local prefix,
    then the fewest requests in flight, then the lowest rank."""
    if len(state.rows) == 1:
        return 0
    c = view.columns
    at = np.flatnonzero(c.worker == state.worker)
    best = first_min(-c.local_blocks[at], c.in_flight[at], c.dp_rank[at])
    return int(c.dp_rank[at[best]])


#: Up to this many hits, `_MediaOf.one` looks for a worker's in Python.
_FEW_HITS = 32


class _MediaOf:
    """A (worker, rank)'s raw medium name -> blocks, from the match's columns (compact:
    the floors every candidate holds, and the hits above them), for a `WorkerView`
    made on demand."""

    __slots__ = ("_floor", "_hits")

    def __init__(self, hits: MatchColumns) -> None:
        self._hits = hits
        self._floor: dict[str, int] | None = None  # made on first use: most views never ask

    def _floors(self) -> dict[str, int]:
        if self._floor is None:
            h = self._hits
            self._floor = {h.medium_name(code): blocks for code, blocks in h.floors}
        return self._floor

    def floor(self) -> dict[str, int]:
        return dict(self._floors())

    def one(self, worker: int, dp_rank: int) -> dict[str, int]:
        h = self._hits
        media = dict(self._floors())
        if len(h.worker) > _FEW_HITS:
            at = np.flatnonzero((h.worker == worker) & (h.dp_rank == dp_rank)).tolist()
        else:  # a compact match has a few hits: numpy's per-call cost is more than this
            at = [
                i
                for i, (w, r) in enumerate(zip(h.worker.tolist(), h.dp_rank.tolist(), strict=True))
                if w == worker and r == dp_rank
            ]
        for i in at:
            name = h.medium_name(int(h.medium[i]))
            blocks = int(h.blocks[i])
            if blocks > media.get(name, 0):
                media[name] = blocks
        return media

    def every(self) -> dict[tuple[int, int], dict[str, int]]:
        h = self._hits
        names = {c: h.medium_name(c) for c in set(h.medium.tolist())}
        out: dict[tuple[int, int], dict[str, int]] = {}
        for worker, rank, code, blocks in zip(
            h.worker.tolist(), h.dp_rank.tolist(), h.medium.tolist(), h.blocks.tolist(), strict=True
        ):
            media = out.get((worker, rank))
            if media is None:
                media = out[(worker, rank)] = dict(self._floors())
            name = names[code]
            if blocks > media.get(name, 0):
                media[name] = blocks
        return out
