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

import numpy as np

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
        if not len(view):
            return self.no_workers()
        c = view.columns
        bs = view.block_size
        request_blocks = -(-request.prompt_tokens // bs)
        g_c, c_c, d_c = self.credits
        gpu = c.gpu_blocks
        cpu = np.maximum(c.cpu_blocks - gpu, 0)
        disk = np.maximum(c.disk_blocks - np.maximum(gpu, c.cpu_blocks), 0)
        overlap = g_c * gpu + c_c * cpu + d_c * disk
        prefill = c.queued_prefill_tokens / bs + request_blocks
        decode = c.kv_usage * c.capacity_blocks
        costs = self.prefill_load_scale * np.maximum(prefill - overlap, 0.0) + decode
        if self.temperature <= 0:
            ties = np.flatnonzero(costs == costs.min())
            # as rng.choice(ties) draws: one index below the count
            at = int(ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))])
        else:
            values = costs.tolist()
            top = max(values) or 1.0
            # math.exp, not numpy's: the weights (and so the draws) stay bit for bit
            weights = [math.exp(-(v / top) / self.temperature) for v in values]
            at = self.rng.choices(range(len(values)), weights=weights)[0]
        return self.decide(request, view, view.worker_at(at))
