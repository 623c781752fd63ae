"""llm-d's precise prefix-cache scorer with its weighted scorers (llm-d inference scheduler).

Scores are in [0, 1] and summed with weights; the highest total wins (ties at random):
- prefix: the longest consecutive cached prefix, each block weighted by its tier
  (GPU 1.0, CPU 0.8), divided by the request's blocks;
- queue: min-max normalised requests in flight (fewest = 1);
- KV utilisation: 1 - fraction of KV blocks in use.
"""

from __future__ import annotations

from typing import Any

from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View


class LlmdPrecisePrefix(Router):
    name = "llm-d"
    summary = "llm-d precise prefix scorer (GPU 1.0 / CPU 0.8) + queue + KV-util scorers"
    source = "llm-d kv-cache-manager precise-prefix-cache-scorer; inference-scheduler scorers"

    def __init__(
        self,
        *,
        prefix_weight: float = 3.0,
        queue_weight: float = 2.0,
        kv_weight: float = 2.0,
        gpu_tier_weight: float = 1.0,
        cpu_tier_weight: float = 0.8,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.weights = (prefix_weight, queue_weight, kv_weight)
        self.tiers = (gpu_tier_weight, cpu_tier_weight)

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        n = max(len(request.content_keys), 1)
        wp, wq, wk = self.weights
        tg, tc = self.tiers
        queues = [w.in_flight for w in view.workers]
        qlo, qhi = min(queues), max(queues)
        best_score, best = -1.0, []
        for w in view.workers:
            gpu = w.gpu_blocks
            lower = max(w.cpu_blocks, w.disk_blocks) - gpu
            prefix = (tg * gpu + tc * max(lower, 0)) / n
            queue = 1.0 if qhi == qlo else (qhi - w.in_flight) / (qhi - qlo)
            score = wp * prefix + wq * queue + wk * (1.0 - w.kv_usage)
            if score > best_score + 1e-12:
                best_score, best = score, [w]
            elif abs(score - best_score) <= 1e-12:
                best.append(w)
        choice = best[0] if len(best) == 1 else self.rng.choice(best)
        return self.decide(request, view, choice)
