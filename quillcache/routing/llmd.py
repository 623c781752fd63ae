"""llm-d's precise prefix-cache scorer with its weighted scorers (llm-d inference scheduler).

Scores are in [0, 1] and summed with weights (precise prefix 2, KV utilisation 1,
queue 1: the scheduling profile of llm-d-inference-scheduler's
deploy/config/epp-precise-prefix-cache-config.yaml and of llm-d's
precise-prefix-cache-aware guide); the highest total wins (ties at random):
- prefix: the longest consecutive cached prefix, each block weighted by its tier
  (GPU 1.0, CPU 0.8), min-max normalised over the workers holding any of it (all
  equal: 1), 0 for a worker holding none (`indexedScoresToNormalizedScoredPods`);
- queue: min-max normalised requests in flight (fewest = 1; llm-d's queue scorer reads
  the engine's waiting requests, which the view does not carry);
- KV utilisation: 1 - fraction of KV blocks in use.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache._native import best_positions
from quillcache._native import llmd_scores as native_llmd_scores
from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View


class LlmdPrecisePrefix(Router):
    name = "llm-d"
    summary = "llm-d precise prefix scorer (GPU 1.0 / CPU 0.8) x2 + KV-util x1 + queue x1"
    source = "llm-d kv-cache-manager precise-prefix-cache-scorer; inference-scheduler scorers"

    def __init__(
        self,
        *,
        prefix_weight: float = 2.0,
        queue_weight: float = 1.0,
        kv_weight: float = 1.0,
        gpu_tier_weight: float = 1.0,
        cpu_tier_weight: float = 0.8,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.tiers = (gpu_tier_weight, cpu_tier_weight)

    def scores(self, view: View) -> npt.NDArray[np.float64]:
        """`llm_d_scores` from the native kernel (`quillcache._native.llmd_scores`): the
        same numbers in one pass over the rows (`tests/routing/test_anchor_kernels.py`)."""
        c = view.columns
        wp, wq, wk = self.weights
        tg, tc = self.tiers
        return native_llmd_scores(
            np.ascontiguousarray(c.load),
            np.ascontiguousarray(c.capacity_blocks),
            c.gpu_blocks,
            c.cpu_blocks,
            c.disk_blocks,
            c.pending_blocks,
            prefix_weight=wp,
            queue_weight=wq,
            kv_weight=wk,
            gpu_tier_weight=tg,
            cpu_tier_weight=tc,
        )

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        scores = self.scores(view)
        # Ties within 1e-12, as the scheduler compares them, in view order. Only scores
        # near the top can end among them (a later one above the best by more than the
        # tolerance starts the list again), so only those are walked.
        # (`flatnonzero(scores >= scores.max() - _NEAR)` in one native pass)
        near = best_positions(scores, _NEAR, lowest=False)
        best_score, best = -1.0, []
        for i in near:
            score = float(scores[i])
            if score > best_score + 1e-12:
                best_score, best = score, [i]
            elif abs(score - best_score) <= 1e-12:
                best.append(i)
        at = best[0] if len(best) == 1 else best[self.rng.randrange(len(best))]
        return self.decide_at(request, view, at)


def llm_d_scores(
    view: View, weights: tuple[float, float, float], tiers: tuple[float, float]
) -> npt.NDArray[np.float64]:
    """Every row's weighted score (higher is better): the readable reference of what
    `route` gets from the native kernel."""
    c = view.columns
    wp, wq, wk = weights
    tg, tc = tiers
    gpu = c.gpu_blocks
    lower = np.maximum(c.cpu_blocks, c.disk_blocks) - gpu
    prefix = normalised_hits(tg * gpu + tc * np.maximum(lower, 0))
    queues = c.in_flight
    qlo, qhi = queues.min(), queues.max()
    queue = np.ones(len(queues)) if qhi == qlo else (qhi - queues) / (qhi - qlo)
    scores: npt.NDArray[np.float64] = wp * prefix + wq * queue + wk * (1.0 - c.kv_usage)
    return scores


#: Scores this far below the top are never among the tied best (see `route`).
_NEAR = 1e-9


def normalised_hits(hits: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    """llm-d's prefix score: the workers with a hit min-max normalised among themselves
    (all equal: 1.0), the others 0."""
    held = hits > 0
    if not held.any():
        return np.zeros(len(hits))
    lo, hi = hits[held].min(), hits[held].max()
    if lo == hi:
        return held.astype(np.float64)
    return np.where(held, (hits - lo) / (hi - lo), 0.0)
