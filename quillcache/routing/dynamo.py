"""Dynamo's KV router cost (NVIDIA Dynamo, `lib/llm/src/kv_router`, docs/router).

    cost(worker) = prefill_load_scale * max(prefill_blocks - credit * overlap, 0)
                   + decode_blocks

`prefill_blocks`: the worker's queued prefill plus this request's blocks; `overlap`:
the blocks it already holds, credited per tier; `decode_blocks`: the KV blocks its
running requests occupy. Temperature 0 picks the argmin (ties at random); a positive
temperature samples from a softmax over the normalised negated costs.
"""

from __future__ import annotations

import math
from typing import Any

from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View


class DynamoKvCost(Router):
    name = "dynamo"
    summary = "Dynamo KV cost: scaled (prefill - credit*overlap) + decode blocks"
    source = "NVIDIA Dynamo KV router (docs/router/kv_cache_routing.md, --kv-overlap-score-weight)"

    def __init__(
        self,
        *,
        prefill_load_scale: float = 1.0,
        gpu_credit: float = 1.0,
        cpu_credit: float = 0.75,
        disk_credit: float = 0.5,
        temperature: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.prefill_load_scale = prefill_load_scale
        self.credits = (gpu_credit, cpu_credit, disk_credit)
        self.temperature = temperature

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        bs = view.block_size
        request_blocks = -(-request.prompt_tokens // bs)
        g_c, c_c, d_c = self.credits
        costs = []
        for w in view.workers:
            gpu = w.gpu_blocks
            cpu = max(w.cpu_blocks - gpu, 0)
            disk = max(w.disk_blocks - max(gpu, w.cpu_blocks), 0)
            overlap = g_c * gpu + c_c * cpu + d_c * disk
            prefill = w.queued_prefill_tokens / bs + request_blocks
            decode = w.kv_usage * w.capacity_blocks
            costs.append(self.prefill_load_scale * max(prefill - overlap, 0.0) + decode)
        if self.temperature <= 0:
            best = min(costs)
            ties = [w for w, c in zip(view.workers, costs, strict=True) if c == best]
            choice = ties[0] if len(ties) == 1 else self.rng.choice(ties)
        else:
            top = max(costs) or 1.0
            weights = [math.exp(-(c / top) / self.temperature) for c in costs]
            choice = self.rng.choices(view.workers, weights=weights)[0]
        return self.decide(request, view, choice)
