"""Preble's E2 (exploit / explore) scheduling (Srivatsa et al., "Preble", ICLR 2025).

Exploit: when the longest cached prefix on some worker is longer than the part of the
prompt that would still be computed, go there (fewest requests in flight breaks ties).
Explore: otherwise pick the worker with the least total cost = its load (queued prefill
and running decode time) + this request's prefill time there + the cost of the cached
blocks it would have to evict to make room (their recompute time).
Preble's post-assignment load rebalancing and prefix autoscaling are not modelled.
"""

from __future__ import annotations

from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View, WorkerView


class PrebleE2(Router):
    name = "preble"
    summary = "Preble E2: exploit a long cached prefix, else explore the least-cost worker"
    source = "Preble (ICLR'25), section 4 'E2 global scheduler'"

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        bs = view.block_size
        best = max(view.workers, key=lambda w: (w.gpu_blocks, -w.in_flight, -w.worker))
        matched = best.gpu_blocks * bs
        if matched > request.prompt_tokens - matched:
            return self.decide(request, view, best, "exploit")

        cost = view.cost

        def total(w: WorkerView) -> tuple[float, int]:
            new_tokens = max(request.prompt_tokens - w.gpu_blocks * bs, 1)
            load = cost.queue_time(w.queued_prefill_tokens) + w.running_decodes * (
                cost.decode_step_time(max(w.running_decodes, 1), w.mean_context_tokens)
                / max(w.running_decodes, 1)
            )
            free = w.capacity_blocks * (1.0 - w.kv_usage)
            evict_blocks = max(-(-new_tokens // bs) - free, 0.0)
            evict = cost.prefill_time(int(evict_blocks * bs)) if evict_blocks else 0.0
            return (
                load + cost.prefill_time(new_tokens, request.prompt_tokens - new_tokens) + evict,
                w.worker,
            )

        return self.decide(request, view, min(view.workers, key=total), "explore")
