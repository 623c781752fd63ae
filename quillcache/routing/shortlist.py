"""What a router tells the booking step of several gateways: its shortlist.

With several gateway replicas on shared state (docs/state.md), a replica's router
decides on its own view and the booking step in Redis takes the first candidate of an
ordered shortlist that is still under its ceiling: the load at which the router would
stop preferring it. Only the router knows that trade-off, so a router may give the
shortlist itself (`Router.shortlist`): rows of the view in the order it prefers them,
its decision's row first, each with

- `requests`: how many requests like this one the row stays preferred for, counted
  from the load the view shows (1: this request and no other that lands there first);
- `pending_requests`: how many more when the booking step finds the request's prefix
  being computed there by another replica's request (in proportion to the part of the
  prefix being computed).

The state layer turns counts into its load units (`quillcache.state.shortlist`), so a
router never sees how the fleet's load is weighed. A router that gives no shortlist
(the default) gets one derived from its decision and the view.

`cost_preferences` is the shortlist of a router that minimises an estimated time
(its own score per row): a row stays preferred while its score plus the queue that
requests like this one add stays at or below the best other row's score, and a prefix
being computed there is worth the prefill time it saves, in the same requests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from quillcache.costmodel.model import CostModel, prefill_pairs
from quillcache.routing.types import Request, View


@dataclass(frozen=True, slots=True)
class Preference:
    """One shortlist row (module docstring)."""

    position: int  # the row of the view
    requests: float  # >= 0; how many requests like this one it stays preferred for
    pending_requests: float = 0.0  # >= 0; how many more with the prefix being computed there


class ShortlistContractError(ValueError):
    """A router's shortlist that the booking step cannot use (the message says why)."""


def check_preferences(
    preferences: list[Preference], view_rows: int, position: int, size: int
) -> None:
    """ShortlistContractError unless `preferences` is a shortlist of at most `size`
    distinct rows of a view of `view_rows` rows, starting with the decision's row
    (`position`), every count finite and >= 0."""
    if not preferences:
        raise ShortlistContractError("an empty shortlist (return None for the default)")
    if len(preferences) > size:
        raise ShortlistContractError(f"{len(preferences)} rows, more than the size {size}")
    if preferences[0].position != position:
        raise ShortlistContractError(
            f"the first row is {preferences[0].position}, not the decision's row {position}"
        )
    seen: set[int] = set()
    for p in preferences:
        if not 0 <= p.position < view_rows:
            raise ShortlistContractError(f"row {p.position} is not a row of the view")
        if p.position in seen:
            raise ShortlistContractError(f"row {p.position} is listed twice")
        seen.add(p.position)
        for name, value in (("requests", p.requests), ("pending_requests", p.pending_requests)):
            if not math.isfinite(value) or value < 0:
                raise ShortlistContractError(
                    f"row {p.position}: {name} must be finite and >= 0, got {value!r}"
                )


def cost_preferences(
    request: Request,
    view: View,
    scores: npt.NDArray[np.float64],
    position: int,
    size: int,
    *,
    scores_if_held: npt.NDArray[np.float64] | None = None,
) -> list[Preference]:
    """The shortlist of a router that picks the lowest `scores` (seconds, one per row;
    its decision at `position`): the decision, then the lowest-scored other rows (ties:
    view order).

    A row stays preferred while its score, plus the queue each more request like this
    one adds there, stays within the best other row's score: `requests` is 1 plus its
    lead over that row divided by that queue. `scores_if_held` (a router that counts a
    prefix being computed as reusable): each row's score were the request's whole
    prefix held there; the row then stays preferred for 1 plus its lead with the
    prefix divided by the queue of a request whose prefix is held, and
    `pending_requests` is how many more that is. None: a prefix being computed is
    worth nothing to the router."""
    if not len(scores):
        return []
    c = view.columns
    native = view.cost.kernel.cost_preferences(
        np.ascontiguousarray(scores, dtype=np.float64),
        None if scores_if_held is None else np.ascontiguousarray(scores_if_held, np.float64),
        c.gpu_blocks,
        c.pending_blocks,
        position,
        size,
        request.prompt_tokens,
        len(request.content_keys),
        view.block_size,
    )
    if native is None:  # a NaN score: ordered as numpy orders it
        return reference_preferences(
            request, view, scores, position, size, scores_if_held=scores_if_held
        )
    rows, requests, more = native
    return [Preference(r, q, m) for r, q, m in zip(rows, requests, more, strict=True)]


def reference_preferences(
    request: Request,
    view: View,
    scores: npt.NDArray[np.float64],
    position: int,
    size: int,
    *,
    scores_if_held: npt.NDArray[np.float64] | None = None,
) -> list[Preference]:
    """`cost_preferences` in numpy, the readable reference the native kernel
    (`CostKernel.cost_preferences`) translates operation for operation; also what
    orders NaN scores (last, as `np.partition` does)."""
    n = len(scores)
    if n == 0:
        return []
    cost = view.cost
    c = view.columns
    bs = view.block_size
    prompt = request.prompt_tokens
    blocks = len(request.content_keys)
    k = min(size - 1, n - 1)
    order = [position, *_lowest_others(scores, position, k)]
    two = np.partition(scores, 1)[:2].tolist() if n > 1 else scores.tolist()
    lowest, second = (float(two[0]), float(two[1])) if n > 1 else (float(two[0]), math.inf)
    row_scores = scores[order].tolist()
    gpu = c.gpu_blocks[order].tolist()
    if scores_if_held is not None:
        pending = c.pending_blocks[order].tolist()
        held = [max(g, p) for g, p in zip(gpu, pending, strict=True)]
        if_held = scores_if_held[order].tolist()
    else:
        held = gpu
    # the queue one more request adds where its whole prefix is held
    step_held = _one_more(cost, prompt, blocks * bs)
    out = []
    for j, r in enumerate(order):
        s = float(row_scores[j])
        rival = second if s <= lowest else lowest  # the best row other than r
        step = _one_more(cost, prompt, min(held[j], blocks) * bs)
        requests = _preferred_for(s, rival, step)
        more = 0.0
        if scores_if_held is not None:
            more = max(_preferred_for(float(if_held[j]), rival, step_held) - requests, 0.0)
        out.append(Preference(r, requests, more))
    return out


def _one_more(cost: CostModel, prompt: int, cached: int) -> float:
    """The queue one more request of `prompt` tokens adds where `cached` of them are
    held: its uncached tokens, attending to the cached ones."""
    new = max(prompt - min(cached, prompt), 1)
    return cost.queue_time(new, prefill_pairs(new, prompt - new))


def _lowest_others(scores: npt.NDArray[np.float64], position: int, k: int) -> list[int]:
    """The `k` lowest-scored rows other than `position`, by (score, row), without sorting
    every row: every row up to the k-th lowest, ties included, then by (score, row)
    (argpartition alone may keep any of several tied rows)."""
    if k <= 0:
        return []
    others = np.asarray(scores, dtype=np.float64).copy()
    others[position] = np.inf
    kth = np.partition(others, k - 1)[k - 1]
    near = np.flatnonzero(others <= kth)
    near = near[np.lexsort((near, others[near]))]
    return [int(r) for r in near if r != position][:k]


def _preferred_for(score: float, rival: float, step: float) -> float:
    """1 (this request) plus how many more requests, each adding `step` to `score`,
    keep it at or below `rival`; 1 when any of them is not a positive finite number."""
    if not (step > 0 and math.isfinite(score) and math.isfinite(rival) and math.isfinite(step)):
        return 1.0
    return 1.0 + max(rival - score, 0.0) / step
