"""The TTFT-argmin router: Mooncake's Conductor, also known as `quillcache-greedy`.

It estimates, for every worker, queue + KV transfer + prefill time with the cost model
and picks the smallest. QuillCache's first state-plane router (`quillcache-greedy`) was
the same argmin over the same tiers and decided identically in every run without an
SLO, so it is registered as an alias of this one (`quillcache.routing`).
"""

from __future__ import annotations

from quillcache.routing.base import Router, estimate_ttft_s_array, kernel_rows
from quillcache.routing.shortlist import Preference, cost_preferences
from quillcache.routing.types import Decision, Request, View

#: Views from this many rows on are walked (`CostKernel.ttft_lowest`) rather than scored
#: whole: below it, one pass over every row costs less than the walk's set-up.
WALK_MIN_ROWS = 1024


def lowest_ttft_at(request: Request, view: View) -> int:
    """The position of the lowest estimated TTFT; ties (short prompts cost one weight
    read wherever they go) go to the longer cached prefix, then the fewer requests in
    flight, then the lower id.

    Scored by the cost model's native kernel in one pass over the rows: the same
    numbers as `first_min(estimate_ttft_s_array(request, view), -local, in_flight,
    worker)`, the readable reference (`tests/routing/test_kernels.py`)."""
    kernel = view.cost.kernel
    blocks, prompt, block_size = len(request.content_keys), request.prompt_tokens, view.block_size
    walk = view.load_order(("queued_prefill_tokens",)) if len(view) >= WALK_MIN_ROWS else None
    if walk is not None:
        # A row holding only the floor differs from the others only by its queue, and
        # the estimate grows with the queue: the kernel scores the rows above the floor,
        # then the others from the least queued on, until one scores above the best
        # (`CostKernel.ttft_lowest`). With peer fetch a row's estimate also depends on
        # the best other row: it answers None and every row is scored.
        order, position = walk
        at = kernel.ttft_lowest(
            order, position, view.above_floor(), *kernel_rows(view), blocks, prompt, block_size
        )
        if at is not None:
            return at
    at, _ = kernel.ttft(*kernel_rows(view), blocks, prompt, block_size)
    return at


class MooncakeConductor(Router):
    """Mooncake (FAST'25) Conductor: for each prefill instance, TTFT = queue time +
    prefill time given its prefix match (or, if KV may move between instances, the
    best instance's prefix fetched); pick the minimum. Its early rejection of requests
    whose estimated TTFT or TBT misses the SLO is the control plane's admission stage
    (`quillcache.controlplane.admission`), which applies to every router."""

    name = "mooncake"
    prunes = True
    summary = "Mooncake Conductor: argmin estimated TTFT (queue + transfer + prefill)"
    source = "Mooncake (FAST'25), section 5 'KVCache-centric scheduling'"

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        return self.decide_at(request, view, lowest_ttft_at(request, view))

    def shortlist(self, request: Request, view: View, position: int, size: int) -> list[Preference]:
        """The rows by estimated TTFT, each preferred while its estimate with the queue
        that requests like this one add stays within the best other row's. It counts
        no prefix being computed as reusable, so such a prefix earns no credit."""
        return cost_preferences(request, view, estimate_ttft_s_array(request, view), position, size)
