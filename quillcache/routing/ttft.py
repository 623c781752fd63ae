"""The TTFT-argmin router: Mooncake's Conductor, also known as `quillcache-greedy`.

It estimates, for every worker, queue + KV transfer + prefill time with the cost model
and picks the smallest. QuillCache's first state-plane router (`quillcache-greedy`) was
the same argmin over the same tiers and decided identically in every run without an
SLO, so it is registered as an alias of this one (`quillcache.routing`).
"""

from __future__ import annotations

from quillcache.routing.base import Router, kernel_rows, pruned_lowest
from quillcache.routing.types import Decision, Request, View


def lowest_ttft_at(request: Request, view: View) -> int:
    """The position of the lowest estimated TTFT; ties (short prompts cost one weight
    read wherever they go) go to the longer cached prefix, then the fewer requests in
    flight, then the lower id.

    Scored by the cost model's native kernel in one pass over the rows: the same
    numbers as `first_min(estimate_ttft_s_array(request, view), -local, in_flight,
    worker)`, the readable reference (`tests/routing/test_kernels.py`)."""
    kernel = view.cost.kernel
    blocks, prompt, block_size = len(request.content_keys), request.prompt_tokens, view.block_size
    if not view.cost.config.transfer.allow_peer_fetch:
        # A row holding only the floor differs from the others only by its queue, and
        # the estimate grows with the queue: the least queued few of those rows stand
        # for all of them (`pruned_lowest`). With peer fetch a row's estimate also
        # depends on the best other row, so every row is scored.
        at = pruned_lowest(
            view,
            ("queued_prefill_tokens",),
            lambda rows: kernel.ttft(*kernel_rows(view), blocks, prompt, block_size, at=rows),
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
        return self.decide(request, view, view.worker_at(lowest_ttft_at(request, view)))
