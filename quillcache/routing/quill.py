"""QuillCache's own policy ("quillcache"): TTFT argmin that also counts blocks being
computed right now for an earlier request (speculative residency from the control
plane) as reusable, since the wait for them is already in that worker's queue.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from quillcache.routing.base import Router, estimate_ttft_s
from quillcache.routing.types import Decision, Request, View


class QuillCacheRouter(Router):
    name = "quillcache"
    summary = "TTFT argmin with speculative (in-flight) prefixes and a decode-load term"
    source = "QuillCache (this project); see docs/routing.md"

    def __init__(self, *, decode_weight: float = 0.0, **kw: Any) -> None:
        super().__init__(**kw)
        self.decode_weight = decode_weight

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        best = None
        for w in view.workers:
            if w.pending_blocks > w.gpu_blocks:
                w = replace(w, gpu_blocks=w.pending_blocks)
            score = estimate_ttft_s(request, view, w)
            if self.decode_weight:
                score += self.decode_weight * view.cost.decode_step_time(
                    w.running_decodes + 1, w.mean_context_tokens
                )
            score = (score, -w.local_blocks, w.in_flight, w.worker)
            if best is None or score < best[0]:
                best = (score, w)
        assert best is not None
        return self.decide(request, view, best[1])
