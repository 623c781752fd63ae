"""What a router sees (`Request`, `View`, `WorkerView`) and what it returns (`Decision`).

A router never touches the index or the engines: the control plane builds a `View`
(each routable worker's load and the index's match for this request per medium) and
the router answers with a `Decision` (a worker or a rejection, the per-block plan and
the cost model's estimate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from quillcache.costmodel import CostModel

# Engines name media differently (vLLM "GPU"/"CPU"/"STORAGE", SGLang "CPU_PINNED",
# "DISK", LMCache "cpu"): routers reason about three tiers.
_TIER_OF_MEDIUM = {
    "gpu": "gpu",
    "cpu": "cpu",
    "cpu_pinned": "cpu",
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

    @property
    def local_blocks(self) -> int:
        """Longest prefix this worker can serve without recomputing (any local tier)."""
        return max(self.gpu_blocks, self.cpu_blocks, self.disk_blocks)


@dataclass(slots=True)
class View:
    """The state a router decides on. `workers` holds routable workers only, by id."""

    workers: list[WorkerView]
    block_size: int
    cost: CostModel
    now_s: float = 0.0
    # True in order-only replay (`--timing none`): no time passes, the load fields are
    # a proxy of recent assignments and no latency is measured
    order_only: bool = False

    def by_id(self, worker: int) -> WorkerView:
        for w in self.workers:
            if w.worker == worker:
                return w
        raise KeyError(worker)

    def best_peer_blocks(self, exclude: int) -> tuple[int | None, int]:
        """The worker (other than `exclude`) with the longest GPU prefix, and its length."""
        best, blocks = None, 0
        for w in self.workers:
            if w.worker != exclude and w.gpu_blocks > blocks:
                best, blocks = w.worker, w.gpu_blocks
        return best, blocks


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
    """A router's answer: `worker` is None when the request is rejected (see `reason`)."""

    worker: int | None
    plan: tuple[PlanStep, ...] = ()
    estimate: Estimate | None = None
    reason: str = ""

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
