"""What a router sees (`Request`, `View`, `WorkerView`) and what it returns (`Decision`).

A router never touches the index or the engines: the control plane builds a `View`
(each routable worker's load and the index's match for this request per medium) and
the router answers with a `Decision` (a worker or a rejection, the per-block plan and
the cost model's estimate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from quillcache._native import LoadOrder
    from quillcache.controlplane.explain import Explanation
    from quillcache.costmodel import CostModel

# Engines name media differently (vLLM "GPU"/"CPU"/"STORAGE", SGLang "CPU_PINNED",
# "DISK", LMCache's connectors "cpu"/"CPU", LMCache's controller the names of its
# storage backends): routers reason about three tiers. LMCache's local CPU backend is
# host memory of the engine; each other backend (local disk, GDS, remote, peer, P/D)
# is fetched over a disk-class path, the default of unknown names too.
_TIER_OF_MEDIUM = {
    "gpu": "gpu",
    "cpu": "cpu",
    "cpu_pinned": "cpu",
    "localcpubackend": "cpu",
    "storage": "disk",
    "disk": "disk",
    "external": "disk",
}


def tier_of(medium: str) -> str:
    """The tier ("gpu", "cpu" or "disk") an engine's medium name belongs to."""
    return _TIER_OF_MEDIUM.get(medium.lower(), "disk")


@dataclass(frozen=True, slots=True)
class SLO:
    """Service-level objective of one request; None means no bound."""

    ttft_s: float | None = None
    tbt_s: float | None = None


@dataclass(slots=True)
class Request:
    """One inference request as the control plane knows it before routing."""

    request_id: int | str
    content_keys: npt.NDArray[np.uint64]  # one per full block, chained (docs/content-key.md)
    prompt_tokens: int
    namespace: int = 0  # namespace id the keys are chained from
    session_id: str | None = None
    expected_output_tokens: int = 0
    slo: SLO | None = None
    arrival_s: float = 0.0
    # the request this one follows, when the client says so (an agent DAG's parent, a
    # conversation's previous turn): routers may keep it with its parent
    parent_id: int | str | None = None


@dataclass(slots=True)
class WorkerView:
    """One routable worker: its load and how much of this request it already holds."""

    worker: int
    in_flight: int = 0  # requests accepted and not finished
    queued_prefill_tokens: int = 0  # prompt tokens still to prefill (queued + partial)
    running_decodes: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use (0..1)
    capacity_blocks: int = 0
    resident_blocks: int = 0  # blocks the index says this worker holds (its "tree size")
    mean_context_tokens: float = 0.0  # of its running decodes
    gpu_blocks: int = 0  # longest prefix of the request resident on its GPU
    cpu_blocks: int = 0  # ... in its CPU tier (any CPU medium)
    disk_blocks: int = 0  # ... in a disk / storage tier
    pending_blocks: int = 0  # ... being computed for an earlier request (speculative)
    matches: dict[str, int] = field(default_factory=dict)  # raw medium name -> blocks
    # False while a source of this worker lost events that replay could not cover: the
    # match fields are then a lower bound (the built-in routers treat the missing part
    # as not cached, i.e. cold, until the source is rebuilt)
    residency_known: bool = True
    # the engine's data-parallel rank this row stands for: a data-parallel engine is one
    # row per rank (each rank has its own KV cache and queue); 0 for the others
    dp_rank: int = 0
    # how many times slower than the fleet's median this engine has turned out to be
    # (1.0: as fast as the rest or not known to be slower; the control plane learns it
    # from the requests' observed time to first token, controlplane/pace.py)
    pace: float = 1.0
    # its engine's sequence slots (`max_num_seqs`, when configured per engine; 0: the
    # cost model's)
    max_num_seqs: int = 0
    # the attention (query, key) pairs of its queued prefill, summed over the queued
    # requests (`costmodel.prefill_pairs` of each): prices the queue as the requests it
    # holds, each attending to its own context
    queued_prefill_pairs: float = 0.0

    @property
    def local_blocks(self) -> int:
        """Longest prefix this worker can serve without recomputing (any local tier)."""
        return max(self.gpu_blocks, self.cpu_blocks, self.disk_blocks)


#: A worker's load columns (`WorkerColumns.load`), in order.
LOAD_FIELDS: tuple[str, ...] = (
    "in_flight",
    "queued_prefill_tokens",
    "running_decodes",
    "kv_usage",
    "mean_context_tokens",
    "queued_prefill_pairs",
)
#: The plane's own per-worker columns (`WorkerColumns.fleet`), in order.
FLEET_FIELDS: tuple[str, ...] = (
    "capacity_blocks",
    "resident_blocks",
    "residency_known",
    "pace",
    "max_num_seqs",
)
#: Up to this many rows, `View.position` scans Python lists (numpy's per-call cost on a
#: few rows is many times the comparison).
_FEW_ROWS = 64
#: Where `WorkerColumns.fleet` holds the pace, and the engine's sequence slots.
PACE_COLUMN = FLEET_FIELDS.index("pace")
SLOTS_COLUMN = FLEET_FIELDS.index("max_num_seqs")


@dataclass(frozen=True, slots=True)
class WorkerColumns:
    """The routable workers as arrays, one row per (worker, data-parallel rank) in `View`
    order (by id, then rank): what a router reads to score a fleet without one object
    per worker. A worker without data parallelism is one row (rank 0)."""

    worker: npt.NDArray[np.uint64]  # ids: 0 .. 2**64-1 (repeated for each rank of a worker)
    load: npt.NDArray[np.float64]  # (n, len(LOAD_FIELDS))
    fleet: npt.NDArray[np.float64]  # (n, len(FLEET_FIELDS))
    gpu_blocks: npt.NDArray[np.int64]
    cpu_blocks: npt.NDArray[np.int64]
    disk_blocks: npt.NDArray[np.int64]
    pending_blocks: npt.NDArray[np.int64]
    dp_rank: npt.NDArray[np.int64]
    # True when some row's pace is not 1.0: a kernel reads `pace` only then
    paced: bool = False
    # True when some row has its own sequence slots: a kernel reads `max_num_seqs` only
    # then
    slotted: bool = False

    @property
    def in_flight(self) -> npt.NDArray[np.float64]:
        return self.load[:, 0]

    @property
    def queued_prefill_tokens(self) -> npt.NDArray[np.float64]:
        return self.load[:, 1]

    @property
    def running_decodes(self) -> npt.NDArray[np.float64]:
        return self.load[:, 2]

    @property
    def kv_usage(self) -> npt.NDArray[np.float64]:
        return self.load[:, 3]

    @property
    def mean_context_tokens(self) -> npt.NDArray[np.float64]:
        return self.load[:, 4]

    @property
    def queued_prefill_pairs(self) -> npt.NDArray[np.float64]:
        return self.load[:, 5]

    @property
    def local_blocks(self) -> npt.NDArray[np.int64]:
        """`WorkerView.local_blocks` per worker: the longest prefix in any local tier."""
        return np.maximum(np.maximum(self.gpu_blocks, self.cpu_blocks), self.disk_blocks)

    @property
    def capacity_blocks(self) -> npt.NDArray[np.float64]:
        return self.fleet[:, 0]

    @property
    def resident_blocks(self) -> npt.NDArray[np.float64]:
        return self.fleet[:, 1]

    @property
    def residency_known(self) -> npt.NDArray[np.bool_]:
        return self.fleet[:, 2] != 0.0

    @property
    def pace(self) -> npt.NDArray[np.float64]:
        """`WorkerView.pace` per row (at least 1.0)."""
        return self.fleet[:, PACE_COLUMN]

    @property
    def max_num_seqs(self) -> npt.NDArray[np.float64]:
        """`WorkerView.max_num_seqs` per row (0: the cost model's)."""
        return self.fleet[:, SLOTS_COLUMN]

    @classmethod
    def of(cls, workers: Sequence[WorkerView]) -> WorkerColumns:
        """The columns of a list of `WorkerView`s."""
        n = len(workers)
        load = np.array(
            [[getattr(w, f) for f in LOAD_FIELDS] for w in workers], dtype=np.float64
        ).reshape(n, len(LOAD_FIELDS))
        fleet = np.array(
            [
                [
                    w.capacity_blocks,
                    w.resident_blocks,
                    float(w.residency_known),
                    w.pace,
                    w.max_num_seqs,
                ]
                for w in workers
            ],
            dtype=np.float64,
        ).reshape(n, len(FLEET_FIELDS))

        def ints(field: str) -> npt.NDArray[np.int64]:
            return np.fromiter((getattr(w, field) for w in workers), np.int64, n)

        return cls(
            np.fromiter((w.worker for w in workers), np.uint64, n),
            load,
            fleet,
            ints("gpu_blocks"),
            ints("cpu_blocks"),
            ints("disk_blocks"),
            ints("pending_blocks"),
            ints("dp_rank"),
            paced=any(w.pace != 1.0 for w in workers),
            slotted=any(w.max_num_seqs for w in workers),
        )


class MediaOf(Protocol):
    """Each (worker, rank)'s raw medium name -> blocks (`WorkerView.matches`), made on
    demand."""

    def one(self, worker: int, dp_rank: int) -> dict[str, int]: ...

    def every(self) -> dict[tuple[int, int], dict[str, int]]:
        """Every (worker, rank) holding more than `floor()` (the others hold that)."""
        ...

    def floor(self) -> dict[str, int]:
        """What every candidate holds (a prompt every engine has), per medium."""
        ...


class _NoMedia:
    def one(self, worker: int, dp_rank: int) -> dict[str, int]:
        return {}

    def every(self) -> dict[tuple[int, int], dict[str, int]]:
        return {}

    def floor(self) -> dict[str, int]:
        return {}


class RowOrder(Protocol):
    """What a view built by the control plane knows about its rows' order, so that a
    router scores the rows that can win instead of every row (`View.prunable`)."""

    def least_loaded(self, fields: tuple[str, ...], k: int) -> npt.NDArray[np.intp]:
        """Positions of the `k` rows lowest by `fields` (`LOAD_FIELDS` names compared in
        order), then by worker id, then by rank; in that order."""
        ...

    def above_floor(self) -> npt.NDArray[np.intp]:
        """Positions (ascending) of the rows that hold more of the request than the
        floor every candidate holds, or have blocks of it being computed: every other
        row holds exactly the floor, nothing pending."""
        ...

    def load_order(self, fields: tuple[str, ...]) -> tuple[LoadOrder, npt.NDArray[np.intp]]:
        """The plane's rows in order of `fields` (a native structure a kernel walks),
        and each plane row's position in the view (negative: not a candidate)."""
        ...


def as_count(x: float) -> Any:
    """A count as an int (the columns hold float64); a fractional driver figure kept."""
    return int(x) if x.is_integer() else x


class View:
    """The state a router decides on: the routable workers, by id.

    Two ways to read it: `columns` (arrays, what the built-in routers score at fleet
    size) and `workers` (a `WorkerView` per worker, made on first use, for routers
    that loop). `worker_at(i)` makes just one."""

    __slots__ = (
        "_best_peer",
        "_columns",
        "_media_of",
        "_order",
        "_workers",
        "block_size",
        "cost",
        "now_s",
        "order_only",
    )

    def __init__(
        self,
        workers: Sequence[WorkerView] | None,
        block_size: int,
        cost: CostModel,
        now_s: float = 0.0,
        order_only: bool = False,
        *,
        columns: WorkerColumns | None = None,
        media_of: MediaOf | None = None,
        order: RowOrder | None = None,
    ) -> None:
        if (workers is None) == (columns is None):
            raise TypeError("a View is made of workers or of columns, exactly one")
        self._workers = list(workers) if workers is not None else None
        self._columns = columns
        self._media_of: MediaOf = media_of or _NoMedia()
        self._order = order
        self._best_peer: tuple[int, int] | None = None
        self.block_size = block_size
        self.cost = cost
        self.now_s = now_s
        # True in order-only replay (`--timing none`): no time passes, the load fields
        # are a proxy of recent assignments and no latency is measured
        self.order_only = order_only

    @property
    def columns(self) -> WorkerColumns:
        if self._columns is None:
            self._columns = WorkerColumns.of(self._workers or [])
        return self._columns

    @property
    def workers(self) -> list[WorkerView]:
        if self._workers is None:
            c = self.columns
            media = self._media_of.every()
            floor = self._media_of.floor()
            self._workers = [
                WorkerView(
                    wid,
                    as_count(in_flight),
                    as_count(queued),
                    as_count(decodes),
                    kv_usage,
                    as_count(capacity),
                    as_count(resident),
                    mean_context,
                    gpu,
                    cpu,
                    disk,
                    pending,
                    media.get((wid, rank)) or dict(floor),
                    known != 0.0,
                    rank,
                    pace,
                    int(slots),
                    pairs,
                )
                for wid, (in_flight, queued, decodes, kv_usage, mean_context, pairs), (
                    capacity,
                    resident,
                    known,
                    pace,
                    slots,
                ), gpu, cpu, disk, pending, rank in zip(
                    c.worker.tolist(),
                    c.load.tolist(),
                    c.fleet.tolist(),
                    c.gpu_blocks.tolist(),
                    c.cpu_blocks.tolist(),
                    c.disk_blocks.tolist(),
                    c.pending_blocks.tolist(),
                    c.dp_rank.tolist(),
                    strict=True,
                )
            ]
        return self._workers

    def __len__(self) -> int:
        if self._workers is not None:
            return len(self._workers)
        return len(self.columns.worker)

    def worker_at(self, i: int) -> WorkerView:
        """The `i`-th worker's view (made alone when the list was not made yet)."""
        if self._workers is not None:
            return self._workers[i]
        return self._make(i)

    def _make(self, i: int) -> WorkerView:
        c = self.columns
        in_flight, queued, decodes, kv_usage, mean_context, pairs = c.load[i].tolist()
        capacity, resident, known, pace, slots = c.fleet[i].tolist()
        wid = int(c.worker[i])
        rank = int(c.dp_rank[i])
        return WorkerView(
            wid,
            as_count(in_flight),
            as_count(queued),
            as_count(decodes),
            kv_usage,
            as_count(capacity),
            as_count(resident),
            mean_context,
            int(c.gpu_blocks[i]),
            int(c.cpu_blocks[i]),
            int(c.disk_blocks[i]),
            int(c.pending_blocks[i]),
            self._media_of.one(wid, rank),
            known != 0.0,
            rank,
            pace,
            int(slots),
            pairs,
        )

    @property
    def prunable(self) -> bool:
        """True when `least_loaded` and `above_floor` come from the control plane's
        ordered load structure (cost O(k log n), not O(n)) and the view is large enough
        for pruning to pay: a router whose choice among the rows holding only the floor
        is monotone in some load fields scores `above_floor()` plus the least loaded of
        the rest. False: they are computed from the columns (correct, not cheaper)."""
        return self._order is not None

    def least_loaded(self, fields: tuple[str, ...], k: int) -> npt.NDArray[np.intp]:
        """Positions of the `k` rows lowest by `fields` (`LOAD_FIELDS` names, compared in
        order, -0.0 as 0.0), then by worker id, then by rank; in that order."""
        if self._order is not None:
            return self._order.least_loaded(fields, k)
        c = self.columns
        columns = [c.load[:, LOAD_FIELDS.index(f)] + 0.0 for f in fields]
        # np.lexsort sorts by its last key first
        order = np.lexsort((c.dp_rank, c.worker, *reversed(columns)))
        return order[:k].astype(np.intp)

    def above_floor(self) -> npt.NDArray[np.intp]:
        """Positions (ascending) of the rows holding more of the request than every
        candidate holds, or with blocks of it pending; without the control plane's
        match, every row."""
        if self._order is not None:
            return self._order.above_floor()
        return np.arange(len(self), dtype=np.intp)

    def load_order(self, fields: tuple[str, ...]) -> tuple[LoadOrder, npt.NDArray[np.intp]] | None:
        """The control plane's ordered load structure by `fields` and each plane row's
        position in the view, for a native kernel that walks the rows in that order;
        None when the view is not prunable."""
        if self._order is None:
            return None
        return self._order.load_order(fields)

    def position(self, worker: int, dp_rank: int = 0) -> int:
        """Where `worker`'s rank `dp_rank` is in the view; KeyError when it is not a
        candidate."""
        if self._workers is not None:
            for i, w in enumerate(self._workers):
                if w.worker == worker and w.dp_rank == dp_rank:
                    return i
            raise KeyError((worker, dp_rank))
        c = self.columns
        if len(c.worker) <= _FEW_ROWS:  # two numpy calls instead of four
            ranks = c.dp_rank.tolist()
            for i, w in enumerate(c.worker.tolist()):
                if w == worker and ranks[i] == dp_rank:
                    return i
            raise KeyError((worker, dp_rank))
        hits = np.flatnonzero((c.worker == worker) & (c.dp_rank == dp_rank))
        if not len(hits):
            raise KeyError((worker, dp_rank))
        return int(hits[0])

    def by_id(self, worker: int, dp_rank: int = 0) -> WorkerView:
        return self.worker_at(self.position(worker, dp_rank))

    def best_peer_blocks(self, exclude: int) -> tuple[int | None, int]:
        """The worker (other than `exclude`) with the longest GPU prefix, and its length;
        the first in view order among equals. The ranks of one data-parallel engine are
        not each other's peers (nothing moves KV between them)."""
        if self._best_peer is None:
            c = self.columns
            gpu = c.gpu_blocks
            first = second = -1
            if len(gpu):
                first = int(np.argmax(gpu))
                rest = np.where(c.worker == c.worker[first], -1, gpu)
                if rest.max() >= 0:
                    second = int(np.argmax(rest))
            self._best_peer = (first, second)
        for i in self._best_peer:
            if i < 0:
                break
            c = self.columns
            if int(c.worker[i]) != exclude:
                blocks = int(c.gpu_blocks[i])
                return (int(c.worker[i]), blocks) if blocks > 0 else (None, 0)
        return None, 0


class Action(StrEnum):
    """What happens to one block of the request on the chosen worker."""

    REUSE = "reuse"  # already in the worker's GPU cache
    FETCH_TIER = "fetch_tier"  # load from the worker's CPU / disk tier
    FETCH_PEER = "fetch_peer"  # pull from another worker
    RECOMPUTE = "recompute"  # prefill it


@dataclass(frozen=True, slots=True)
class PlanStep:
    """A run of consecutive blocks [start, end) that share an action."""

    action: Action
    start: int
    end: int
    source: str = ""  # tier name ("cpu", "disk") or "worker:<id>" for a peer

    @property
    def blocks(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Estimate:
    """The cost model's estimate for the chosen worker, in seconds."""

    queue_s: float
    transfer_s: float
    prefill_s: float
    tbt_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s


@dataclass(frozen=True, slots=True)
class Decision:
    """A router's answer: `worker` is None when the request is rejected (see `reason`).

    `dp_rank` names the data-parallel rank of `worker` that serves the request; None
    lets the control plane choose (the rank holding the longest prefix, then the least
    loaded): a router that thinks in engines need not know about ranks."""

    worker: int | None
    plan: tuple[PlanStep, ...] = ()
    estimate: Estimate | None = None
    reason: str = ""
    dp_rank: int | None = None
    # set by the control plane when asked to explain its decisions (None otherwise):
    # the KV-optimal row beside the chosen one, `quillcache.controlplane.explain`
    explanation: Explanation | None = None

    @property
    def rejected(self) -> bool:
        return self.worker is None

    @classmethod
    def reject(cls, reason: str, estimate: Estimate | None = None) -> Decision:
        return cls(worker=None, reason=reason, estimate=estimate)

    def actions(self) -> list[Action]:
        """The plan expanded to one action per full block."""
        out: list[Action] = []
        for step in self.plan:
            out.extend([step.action] * step.blocks)
        return out

    def blocks_by_action(self) -> dict[Action, int]:
        counts = dict.fromkeys(Action, 0)
        for step in self.plan:
            counts[step.action] += step.blocks
        return counts
