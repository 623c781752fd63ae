"""Dynamo's KV router cost (NVIDIA Dynamo, `lib/kv-router/src/scheduling/selector/default.rs`,
defaults from `lib/kv-router/src/scheduling/config.rs`; the version followed is in
docs/routing.md, "Anchors").

For an aggregated (or prefill) worker, lower is better:

    raw_prefill_blocks    = (active prefill tokens + prompt tokens) / block_size
    overlap_credit_blocks = credit * device_overlap + host_weight * host_overlap
                            + disk_weight * disk_overlap
    logit = prefill_load_scale * max(raw_prefill_blocks - overlap_credit_blocks, 0)
            + potential_decode_blocks + active_request_weight * active_requests

`credit` is `overlap_score_credit`, divided by 1 + `overlap_score_credit_decay` x
(the worker's prefill backlog above the least loaded worker's, in request sizes).
`potential_decode_blocks` is the worker's active blocks plus the request's blocks it
does not already share with them. Temperature 0 takes the lowest logit (ties at
random); above 0, a softmax over the logits shifted by the lowest and divided by
their range times the temperature (all equal: uniform).

What QuillCache's view stands in for what Dynamo's router tracks itself: active
prefill tokens are the worker's queued prefill tokens; active blocks are the KV blocks
the engine reports in use (`kv_usage` x capacity); the request's blocks already shared
with active sequences are its GPU prefix, or the prefix an in-flight request is
computing there (`pending_blocks`) when that is longer.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache._native import best_positions, dynamo_costs
from quillcache.errors import ConfigError
from quillcache.routing.base import Router
from quillcache.routing.types import Decision, Request, View


class DynamoKvCost(Router):
    name = "dynamo"
    summary = "Dynamo KV cost: scaled (prefill - overlap credit) + potential active blocks"
    source = "NVIDIA Dynamo KV router (lib/kv-router/src/scheduling/selector/default.rs)"

    def __init__(
        self,
        *,
        overlap_score_credit: float = 1.0,
        host_cache_hit_weight: float = 0.75,
        disk_cache_hit_weight: float = 0.25,
        prefill_load_scale: float = 1.0,
        overlap_score_credit_decay: float = 0.0,
        active_request_weight: float = 0.0,
        temperature: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        # Dynamo's own bounds (config.rs validators): a credit or weight outside [0, 1]
        # is refused there, so a run here cannot claim Dynamo with one
        for key, value, top in (
            ("overlap_score_credit", overlap_score_credit, 1.0),
            ("host_cache_hit_weight", host_cache_hit_weight, 1.0),
            ("disk_cache_hit_weight", disk_cache_hit_weight, 1.0),
            ("prefill_load_scale", prefill_load_scale, math.inf),
            ("overlap_score_credit_decay", overlap_score_credit_decay, math.inf),
            ("active_request_weight", active_request_weight, math.inf),
            ("temperature", temperature, math.inf),
        ):
            if not 0.0 <= value <= top:
                bound = f"[0, {top:g}]" if math.isfinite(top) else ">= 0"
                raise ConfigError(f"dynamo: {key} must be {bound}, got {value!r}")
        self.overlap_score_credit = overlap_score_credit
        self.host_cache_hit_weight = host_cache_hit_weight
        self.disk_cache_hit_weight = disk_cache_hit_weight
        self.prefill_load_scale = prefill_load_scale
        self.overlap_score_credit_decay = overlap_score_credit_decay
        self.active_request_weight = active_request_weight
        self.temperature = temperature

    def logits(self, request: Request, view: View) -> npt.NDArray[np.float64]:
        """Every row's cost, lower is better (the formula in the module docstring)."""
        c = view.columns
        bs = view.block_size
        full_blocks = len(request.content_keys)
        device = c.gpu_blocks
        host = np.maximum(c.cpu_blocks - device, 0)
        disk = np.maximum(c.disk_blocks - np.maximum(device, c.cpu_blocks), 0)
        queued = c.queued_prefill_tokens
        credit: float | npt.NDArray[np.float64] = self.overlap_score_credit
        if self.overlap_score_credit_decay > 0:
            request_blocks = max(-(-request.prompt_tokens // bs), 1)
            backlog = (queued - queued.min()) / bs / request_blocks
            credit = self.overlap_score_credit / (1.0 + self.overlap_score_credit_decay * backlog)
        overlap_credit = (
            credit * device + self.host_cache_hit_weight * host + self.disk_cache_hit_weight * disk
        )
        raw_prefill = (queued + request.prompt_tokens) / bs
        shared = np.minimum(np.maximum(device, c.pending_blocks), full_blocks)
        potential_decode = c.kv_usage * c.capacity_blocks + (full_blocks - shared)
        return (
            self.prefill_load_scale * np.maximum(raw_prefill - overlap_credit, 0.0)
            + potential_decode
            + self.active_request_weight * c.in_flight
        )

    def costs(self, request: Request, view: View) -> npt.NDArray[np.float64]:
        """`logits` from the native kernel (`quillcache._native.dynamo_costs`): the same
        numbers in one pass over the rows (`tests/routing/test_anchor_kernels.py`)."""
        c = view.columns
        return dynamo_costs(
            np.ascontiguousarray(c.load),
            np.ascontiguousarray(c.capacity_blocks),
            c.gpu_blocks,
            c.cpu_blocks,
            c.disk_blocks,
            c.pending_blocks,
            len(request.content_keys),
            request.prompt_tokens,
            view.block_size,
            overlap_score_credit=self.overlap_score_credit,
            host_cache_hit_weight=self.host_cache_hit_weight,
            disk_cache_hit_weight=self.disk_cache_hit_weight,
            prefill_load_scale=self.prefill_load_scale,
            overlap_score_credit_decay=self.overlap_score_credit_decay,
            active_request_weight=self.active_request_weight,
        )

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        costs = self.costs(request, view)
        if self.temperature <= 0:
            # `flatnonzero(costs == costs.min())` in one native pass
            ties = best_positions(costs)
            # as rng.choice(ties) draws: one index below the count
            at = ties[0] if len(ties) == 1 else ties[self.rng.randrange(len(ties))]
        else:
            at = self.rng.choices(
                range(len(costs)), weights=softmax_weights(costs, self.temperature)
            )[0]
        return self.decide_at(request, view, at)


def softmax_weights(costs: npt.NDArray[np.float64], temperature: float) -> list[float]:
    """Dynamo's sampling weights (unnormalised): exp(-(cost - min) / ((max - min) * T)),
    all equal when the costs are. math.exp, not numpy's, so that the weights (and the
    draws) are the same bit for bit as a loop over the rows computes them."""
    values = costs.tolist()
    lo, hi = min(values), max(values)
    if lo == hi:
        return [1.0] * len(values)
    scale = (hi - lo) * temperature
    return [math.exp(-(v - lo) / scale) for v in values]
