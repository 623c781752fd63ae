"""QuillCache's own policy ("quillcache"): estimated-TTFT argmin with

1. speculative residency: blocks being computed right now for an earlier request on a
   worker (`WorkerView.pending_blocks`, from the control plane) count as reusable
   there, since their compute is already in that worker's queue;
2. decode interference: the queue estimate charges every prefill step with the
   running decodes' budget share and KV reads (`CostModel.loaded_prefill_time`),
   so a worker full of long decodes is not mistaken for an idle one.

Ties go to the longer reusable prefix, then to fewer requests in flight.
"""

from __future__ import annotations

from typing import Any

from quillcache.errors import ConfigError
from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View, WorkerView


class QuillCacheRouter(Router):
    name = "quillcache"
    summary = "TTFT argmin + the work it adds (load-adaptive), in-flight prefixes, decode load"
    source = "QuillCache (this project); see docs/routing.md"

    def __init__(
        self,
        *,
        speculative: bool = True,
        interference: bool = True,
        work_weight: float = 1.0,
        adaptive: bool = True,
        max_work_weight: float = 3.0,
        work_scope: str = "cluster",
        work_base: float = 1.0,
        decode_weight: float = 1.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.speculative = speculative
        self.interference = interference
        self.work_weight = work_weight
        self.adaptive = adaptive
        self.max_work_weight = max_work_weight
        if work_scope not in ("cluster", "worker"):
            raise ConfigError(f"work_scope must be 'cluster' or 'worker', got {work_scope!r}")
        self.work_scope = work_scope
        self.work_base = work_base
        self.decode_weight = decode_weight
        self._lambda = work_weight
        self._mean_decodes = 0.0

    def estimate_s(self, request: Request, view: View, w: WorkerView) -> float:
        cost = view.cost
        bs = view.block_size
        n = len(request.content_keys)
        gpu = min(max(w.gpu_blocks, w.pending_blocks if self.speculative else 0), n)
        covered, transfer_s = gpu, 0.0
        for tier, blocks in (("cpu", w.cpu_blocks), ("disk", w.disk_blocks)):
            blocks = min(blocks, n)
            if blocks > covered:
                transfer_s += cost.transfer_time(blocks - covered, tier)
                covered = blocks
        if cost.config.transfer.allow_peer_fetch:  # as Router.decide will plan it
            _, peer_blocks = view.best_peer_blocks(exclude=w.worker)
            peer_blocks = min(peer_blocks, n)
            if peer_blocks > covered:
                peer_s = cost.transfer_time(peer_blocks - covered, "peer")
                if peer_s < cost.prefill_time((peer_blocks - covered) * bs, covered * bs):
                    transfer_s += peer_s
                    covered = peer_blocks
        new = max(request.prompt_tokens - min(covered * bs, request.prompt_tokens), 1)
        extra = 0.0
        if self.work_weight:
            # the compute this request adds delays everyone queued after it there
            lam = self._lambda
            if self.adaptive and self.work_scope == "worker":
                waiting = max(w.in_flight - w.running_decodes, 0)
                lam = min(self.work_weight * (self.work_base + waiting), self.max_work_weight)
            extra = lam * cost.prefill_compute_s(new, request.prompt_tokens - new)
        excess = w.running_decodes - self._mean_decodes
        if self.decode_weight and excess > 0:
            # Its KV is read by every step while it decodes, so each co-running decode's
            # tokens come that much later; counted only for the decodes above the
            # cluster mean (piling onto one worker), where going elsewhere avoids it.
            out = request.expected_output_tokens
            extra += (
                self.decode_weight * excess * out * cost.kv_read_s(request.prompt_tokens + out / 2)
            )
        if not self.interference:
            return (
                extra
                + transfer_s
                + cost.queue_time(w.queued_prefill_tokens)
                + cost.prefill_time(new, request.prompt_tokens - new)
            )
        return (
            extra
            + transfer_s
            + cost.loaded_prefill_time(
                queued_tokens=w.queued_prefill_tokens,
                new_tokens=new,
                context_tokens=request.prompt_tokens - new,
                running_decodes=w.running_decodes,
                mean_context_tokens=w.mean_context_tokens,
            )
        )

    def route(self, request: Request, view: View) -> Decision:
        if not view.workers:
            return self.no_workers()
        self._lambda = self.work_weight
        self._mean_decodes = sum(w.running_decodes for w in view.workers) / len(view.workers)
        if self.adaptive and self.work_scope == "cluster":
            # Each second of compute added delays every request that queues behind it:
            # weigh it by how many are waiting per worker right now.
            waiting = sum(max(w.in_flight - w.running_decodes, 0) for w in view.workers)
            self._lambda = min(
                self._lambda * (self.work_base + waiting / len(view.workers)),
                self.max_work_weight,
            )
        best = min(
            view.workers,
            key=lambda w: (
                self.estimate_s(request, view, w),
                -max(w.local_blocks, w.pending_blocks),
                w.in_flight,
                w.worker,
            ),
        )
        if self.speculative and best.pending_blocks > best.gpu_blocks:
            from dataclasses import replace

            best = replace(best, gpu_blocks=best.pending_blocks)
        return self.decide(request, view, best)
