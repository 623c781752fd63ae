"""QuillCache's own policy ("quillcache"): TTFT argmin that also counts blocks being
computed right now for an earlier request (speculative residency from the control
plane) as reusable, since the wait for them is already in that worker's queue.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from quillcache.routing.base import Router, plan_and_estimate
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
            plan, est = plan_and_estimate(request, view, w)
            score = est.ttft_s + self.decode_weight * est.tbt_s
            if best is None or score < best[0]:
                best = (score, w, est, plan)
        assert best is not None
        _, w, est, plan = best
        return Decision(worker=w.worker, plan=plan, estimate=est)
