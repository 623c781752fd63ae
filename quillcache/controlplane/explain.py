"""Why a decision went where it did: the KV-optimal choice beside the chosen one.

A request's *usable prefix* on a (worker, rank) row is what that row can serve without
prefilling it: the longest prefix in any of its local tiers (GPU, CPU, disk) or being
computed there for an earlier request (`pending_blocks`), capped at the request's full
blocks; in tokens, `min(blocks * block_size, prompt_tokens)`. A peer fetch is not
counted: it is the router's plan, not where the prefix lives.

- the *KV-optimal* row: the routable row with the longest usable prefix, the first
  among equals in view order (by worker id, then rank);
- *avoidable* tokens: the KV-optimal row's usable prefix, what the best placement for
  the cache avoids prefilling;
- *avoided* tokens: the chosen row's usable prefix;
- *regret*: avoidable - avoided (>= 0): prefill the choice left for the engine to
  compute that another routable engine holds. A decision is KV-optimal when its regret
  is 0 (it may name another row among equals than `kv_optimal`).

On a prunable view (`View.prunable`) every row but those `above_floor()` holds the
same floor and nothing pending, so the longest prefix is found among those rows and
one floor row: O(candidates), not a pass over the fleet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from quillcache.routing.base import estimate_ttft_s
from quillcache.routing.types import Decision, Request, View

#: Rows listed per explained decision with candidates (the longest usable prefixes,
#: then the chosen and KV-optimal rows): bounded whatever the fleet's size.
MAX_CANDIDATES = 16


@dataclass(frozen=True, slots=True)
class Candidate:
    """One row of the view as an explained decision lists it."""

    worker: int
    dp_rank: int
    usable_blocks: int
    usable_tokens: int
    in_flight: float
    queued_prefill_tokens: float
    running_decodes: float
    # the cost model's estimated TTFT on this row (`routing.base.estimate_ttft_s`): the
    # same yardstick for every router, not the router's own score
    estimated_ttft_s: float

    def as_dict(self) -> dict[str, float | int]:
        return {
            "worker": self.worker,
            "dp_rank": self.dp_rank,
            "usable_blocks": self.usable_blocks,
            "usable_tokens": self.usable_tokens,
            "in_flight": self.in_flight,
            "queued_prefill_tokens": self.queued_prefill_tokens,
            "running_decodes": self.running_decodes,
            "estimated_ttft_s": self.estimated_ttft_s,
        }


@dataclass(frozen=True, slots=True)
class Explanation:
    """One decision beside its KV-optimal alternative (module docstring)."""

    chosen: tuple[int, int] | None  # (worker, rank); None: rejected
    kv_optimal: tuple[int, int] | None  # None: no candidate
    usable_blocks: int  # the chosen row's usable prefix, in blocks
    avoided_tokens: int
    avoidable_tokens: int
    reason: str
    candidates: tuple[Candidate, ...] = ()

    @property
    def regret_tokens(self) -> int:
        return self.avoidable_tokens - self.avoided_tokens

    @property
    def is_kv_optimal(self) -> bool:
        """The choice holds the longest usable prefix (regret 0); False when rejected."""
        return self.chosen is not None and self.regret_tokens == 0

    def as_dict(self) -> dict[str, object]:
        return {
            "chosen": list(self.chosen) if self.chosen is not None else None,
            "kv_optimal": list(self.kv_optimal) if self.kv_optimal is not None else None,
            "kv_optimal_choice": self.is_kv_optimal,
            "usable_blocks": self.usable_blocks,
            "avoided_tokens": self.avoided_tokens,
            "avoidable_tokens": self.avoidable_tokens,
            "regret_tokens": self.regret_tokens,
            "reason": self.reason,
            "candidates": [c.as_dict() for c in self.candidates],
        }


@dataclass(slots=True)
class ExplainTotals:
    """Running totals over routed (not rejected) explained decisions."""

    decisions: int = 0
    kv_optimal: int = 0
    avoided_tokens: int = 0
    avoidable_tokens: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    @property
    def regret_tokens(self) -> int:
        return self.avoidable_tokens - self.avoided_tokens

    def add(self, e: Explanation) -> None:
        if e.chosen is None:
            return
        self.decisions += 1
        self.kv_optimal += e.is_kv_optimal
        self.avoided_tokens += e.avoided_tokens
        self.avoidable_tokens += e.avoidable_tokens


def usable_blocks(view: View, request: Request, at: npt.NDArray[np.intp]) -> npt.NDArray[np.int64]:
    """The usable prefix (module docstring) of the rows at positions `at`, in blocks."""
    c = view.columns
    # the rows' own tiers (`local_blocks` would take the maximum over every row first)
    local = np.maximum(np.maximum(c.gpu_blocks[at], c.cpu_blocks[at]), c.disk_blocks[at])
    return np.minimum(np.maximum(local, c.pending_blocks[at]), len(request.content_keys))


def _rows_that_can_hold_most(view: View, every_row: bool) -> list[int]:
    """Positions (ascending) among which the longest usable prefix lies, first among
    equals included: every row, or on a prunable view the rows above the floor and the
    first row holding just the floor (a few rows: plain Python beats numpy there)."""
    n = len(view)
    if every_row or not view.prunable:
        return list(range(n))
    above: list[int] = view.above_floor().tolist()
    if len(above) >= n:
        return above
    # above is ascending: the first floor row is the first i with above[i] != i
    first_floor = next((i for i, p in enumerate(above) if p != i), len(above))
    above.insert(first_floor, first_floor)
    return above


def _position(view: View, worker: int, dp_rank: int) -> int:
    """`view.position`, by bisection: the view is sorted by id, then rank, and holds a
    worker's ranks side by side from 0. -1 when not a candidate."""
    c = view.columns
    i = int(np.searchsorted(c.worker, worker)) + dp_rank
    if i < len(c.worker) and int(c.worker[i]) == worker and int(c.dp_rank[i]) == dp_rank:
        return i
    try:
        return view.position(worker, dp_rank)
    except KeyError:
        return -1


def tokens_of(blocks: int, view: View, request: Request) -> int:
    return min(blocks * view.block_size, request.prompt_tokens)


def explain(
    request: Request,
    view: View,
    decision: Decision,
    *,
    candidates: bool = False,
    every_row: bool = False,
) -> Explanation:
    """`decision` (for `request` on `view`) beside the KV-optimal row. `candidates`:
    list up to `MAX_CANDIDATES` rows with their usable prefix, load and estimate.
    `every_row`: read every row even on a prunable view (its pending column was filled
    from outside the plane, so `above_floor()` does not know those rows)."""
    rows = _rows_that_can_hold_most(view, every_row)
    chosen: tuple[int, int] | None = None
    chosen_at = -1
    if decision.worker is not None:
        chosen = (decision.worker, decision.dp_rank or 0)
        chosen_at = _position(view, *chosen)
    # one read of the columns for the rows that can hold most and the chosen one
    at = [*rows, chosen_at] if chosen_at >= 0 else rows
    usable = usable_blocks(view, request, np.asarray(at, np.intp))
    held: list[int] = usable.tolist()
    chosen_blocks = held.pop() if chosen_at >= 0 else 0
    kv_optimal: tuple[int, int] | None = None
    best_blocks = 0
    if rows:
        best = max(range(len(held)), key=held.__getitem__)  # the first maximum
        c = view.columns
        kv_optimal = (int(c.worker[rows[best]]), int(c.dp_rank[rows[best]]))
        best_blocks = held[best]
    listed: tuple[Candidate, ...] = ()
    if candidates and rows:
        listed = _candidates(
            request, view, np.asarray(rows, np.intp), usable[: len(rows)], chosen, kv_optimal
        )
    return Explanation(
        chosen=chosen,
        kv_optimal=kv_optimal,
        usable_blocks=chosen_blocks,
        avoided_tokens=tokens_of(chosen_blocks, view, request) if chosen is not None else 0,
        avoidable_tokens=tokens_of(best_blocks, view, request),
        reason=decision.reason,
        candidates=listed,
    )


def _candidates(
    request: Request,
    view: View,
    at: npt.NDArray[np.intp],
    usable: npt.NDArray[np.int64],
    chosen: tuple[int, int] | None,
    kv_optimal: tuple[int, int] | None,
) -> tuple[Candidate, ...]:
    # the longest usable prefixes first (stable: view order among equals)
    order = np.argsort(-usable, kind="stable")[:MAX_CANDIDATES]
    positions = [int(at[i]) for i in order]
    for row in (kv_optimal, chosen):
        if row is None:
            continue
        pos = _position(view, *row)
        if pos >= 0 and pos not in positions:
            positions.append(pos)
    out = []
    for pos in positions:
        w = view.worker_at(pos)
        blocks = int(usable_blocks(view, request, np.array([pos], np.intp))[0])
        out.append(
            Candidate(
                worker=w.worker,
                dp_rank=w.dp_rank,
                usable_blocks=blocks,
                usable_tokens=tokens_of(blocks, view, request),
                in_flight=float(w.in_flight),
                queued_prefill_tokens=float(w.queued_prefill_tokens),
                running_decodes=float(w.running_decodes),
                estimated_ttft_s=estimate_ttft_s(request, view, w),
            )
        )
    return tuple(out)
