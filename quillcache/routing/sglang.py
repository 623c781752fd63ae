"""SGLang router's cache-aware policy (sgl-router, `policies/cache_aware`).

If the load is imbalanced (max - min > `balance_abs_threshold` AND max >
`balance_rel_threshold` * min, load = requests in flight) route to the least-loaded
worker. Otherwise route to the worker with the highest prefix match rate if it exceeds
`cache_threshold`, else to the worker with the smallest cache tree (most free cache).
Defaults: sgl-router's (`cache_threshold` 0.3, `balance_abs_threshold` 64,
`balance_rel_threshold` 1.5; the version followed is in docs/routing.md, "Anchors").

SGLang approximates each worker's cache with a radix tree of the text it routed there;
here the match and the tree size come from the event-driven index instead. The tree
holds a prompt from the moment it is routed, before the engine has computed (or
reported) it, so the match here is the longer of the worker's GPU prefix and the
prefix an in-flight request is computing there (`pending_blocks`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from quillcache._native import sglang_pick as native_sglang_pick
from quillcache.routing.base import Router, first_min
from quillcache.routing.types import Decision, Request, View


class SglangCacheAware(Router):
    name = "sglang"
    summary = "SGLang cache-aware: match > 0.3 wins unless load is imbalanced (64 / 1.5x)"
    source = "SGLang sgl-router cache_aware policy (defaults 0.3, 64, 1.5)"

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        c = view.columns
        # the three rows it may choose, in one native pass (`candidates` is the numpy
        # reference, tests/routing/test_anchor_kernels.py)
        least, longest, smallest = native_sglang_pick(
            np.ascontiguousarray(c.load),
            np.ascontiguousarray(c.fleet),
            c.worker,
            c.gpu_blocks,
            c.pending_blocks,
            float(self.balance_abs_threshold),
            float(self.balance_rel_threshold),
        )
        if least >= 0:
            return self.decide_at(request, view, least, "load imbalanced: shortest queue")
        held = max(int(c.gpu_blocks[longest]), int(c.pending_blocks[longest]))
        rate = held * view.block_size / max(request.prompt_tokens, 1)
        if rate > self.cache_threshold:
            return self.decide_at(request, view, longest, f"match rate {rate:.2f}")
        return self.decide_at(request, view, smallest, "low match: smallest cache")

    def candidates(self, view: View) -> tuple[int, int, int]:
        """`(least, longest, smallest)`: the positions `route` chooses from, in numpy (the
        readable reference of the native `sglang_pick`): the shortest queue when the
        load is imbalanced (else -1), the longest match, the smallest cache; ties by
        the shortest queue, then the lowest id."""
        c = view.columns
        loads = c.in_flight
        lo, hi = loads.min(), loads.max()
        least = -1
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            # shortest queue, then lowest id
            least = first_min(loads, c.worker)
        # longest match, then shortest queue, then lowest id
        held = np.maximum(c.gpu_blocks, c.pending_blocks)
        longest = np.flatnonzero(held == held.max())
        best = int(longest[first_min(loads[longest], c.worker[longest])])
        # smallest cache, then shortest queue, then lowest id
        small = np.flatnonzero(c.resident_blocks == c.resident_blocks.min())
        smallest = int(small[first_min(loads[small], c.worker[small])])
        return least, best, smallest
