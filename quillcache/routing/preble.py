"""Preble's E2 (exploit / explore) scheduling (Srivatsa et al., "Preble", ICLR 2025).

Exploit: when the longest cached prefix on some worker is longer than the part of the
prompt that would still be computed, go there (fewest requests in flight breaks ties).
Explore: otherwise pick the worker with the least total cost = its load (queued prefill
and running decode time) + this request's prefill time there + the cost of the cached
blocks it would have to evict to make room (their recompute time).
Preble's post-assignment load rebalancing and prefix autoscaling are not modelled.
"""

from __future__ import annotations

import numpy as np

from quillcache.routing.base import Router, first_min
from quillcache.routing.types import Decision, Request, View


class PrebleE2(Router):
    name = "preble"
    summary = "Preble E2: exploit a long cached prefix, else explore the least-cost worker"
    source = "Preble (ICLR'25), section 4 'E2 global scheduler'"

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        bs = view.block_size
        c = view.columns
        gpu = c.gpu_blocks
        # the longest cached prefix, then the fewest in flight, then the lowest id
        # (`first_min(-gpu, ...)`, without negating a fleet's column)
        longest = np.flatnonzero(gpu == gpu.max())
        if len(longest) > 1:
            longest = longest[first_min(c.in_flight[longest], c.worker[longest]) :]
        best = int(longest[0])
        matched = int(gpu[best]) * bs
        if matched > request.prompt_tokens - matched:
            return self.decide_at(request, view, best, "exploit")

        cost = view.cost
        prompt = request.prompt_tokens
        new_tokens = np.maximum(prompt - gpu * bs, 1)
        decodes = c.running_decodes
        busy = np.maximum(decodes, 1)
        load = cost.queue_time_array(c.queued_prefill_tokens, c.queued_prefill_pairs) + decodes * (
            cost.decode_step_time_array(busy, c.mean_context_tokens) / busy
        )
        free = c.capacity_blocks * (1.0 - c.kv_usage)
        evict_blocks = np.maximum(-(-new_tokens // bs) - free, 0.0)
        evict_tokens = np.trunc(evict_blocks * bs)
        evict = np.where(
            evict_blocks != 0, cost.prefill_time_array(evict_tokens, np.zeros_like(free)), 0.0
        )
        total = load + cost.prefill_time_array(new_tokens, prompt - new_tokens) + evict
        return self.decide_at(request, view, first_min(total, c.worker), "explore")
