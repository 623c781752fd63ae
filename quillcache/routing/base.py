"""The `Router` base class a user subclasses, and the plan/estimate helper it offers.

A router is a plain object: `route(request, view) -> Decision`. It may keep state
(a round-robin counter, a random generator seeded at construction) but never reaches
into the index or the engines; everything it may use is in the `View`.

    class FewestRequests(Router):
        name = "fewest-requests"
        def route(self, request, view):
            return self.decide(request, view, min(view.workers, key=lambda w: w.in_flight))
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from quillcache.errors import ConfigError
from quillcache.routing.shortlist import Preference
from quillcache.routing.types import (
    PACE_COLUMN,
    Action,
    Decision,
    Estimate,
    PlanStep,
    Request,
    View,
    WorkerView,
    as_count,
)


class WatchedRandom(random.Random):
    """`random.Random` that counts its draws (every method draws through `random` or
    `getrandbits`; the sequences are `random.Random`'s own), so a run can tell whether
    its router's seed made any difference (`Router.seed_used`)."""

    def __init__(self, seed: int) -> None:
        self.draws = 0
        super().__init__(seed)

    def random(self) -> float:
        self.draws += 1
        return super().random()

    def getrandbits(self, k: int, /) -> int:
        self.draws += 1
        return super().getrandbits(k)


class Router:
    """Base class of every router. Subclasses set `name` and implement `route`."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""  # one line for `quillcache simulate --list-routers`
    source: ClassVar[str] = ""  # where the policy comes from (paper, project, file)
    # True: on a prunable view (`View.prunable`) it scores only the rows that can win
    # (`pruned_lowest`), and decides exactly as it would over every row;
    # tests/routing/test_pruning.py checks that for every router that says so
    prunes: ClassVar[bool] = False

    def __init__(self, *, seed: int = 0, **params: Any) -> None:
        if params:
            raise ConfigError(
                f"router {self.name or type(self).__name__!r} got unknown parameters: "
                + ", ".join(sorted(params))
            )
        self._seed = seed
        self._seed_read = False
        self.rng: random.Random = WatchedRandom(seed)

    @property
    def seed(self) -> int:
        """The seed this router was made with (reading it counts as using it)."""
        self._seed_read = True
        return self._seed

    @property
    def seed_used(self) -> bool:
        """Whether anything so far depended on the seed: a draw from `rng` (the
        `WatchedRandom` it was made with) or a read of `seed`. False after a run: the
        same run with any other seed decides the same (the matrix runs such a run once
        for every seed of a trace's cell)."""
        rng = self.rng
        return self._seed_read or not isinstance(rng, WatchedRandom) or rng.draws > 0

    def route(self, request: Request, view: View) -> Decision:
        raise NotImplementedError

    def shortlist(
        self, request: Request, view: View, position: int, size: int
    ) -> list[Preference] | None:
        """For several gateways on shared state: up to `size` rows of `view` in the
        order this router prefers them, its decision's row (`position`) first, each
        with how many requests like this one it stays preferred for
        (`quillcache.routing.shortlist`). Called right after `route`, with the same
        request and view. None (this default): the booking step derives the shortlist
        from the decision and the view (`quillcache.state.shortlist`)."""
        return None

    def no_workers(self) -> Decision:
        return Decision.reject("no routable worker (all removed or draining)")

    # --- helpers for subclasses -------------------------------------------------

    def decide(
        self, request: Request, view: View, worker: WorkerView, reason: str = ""
    ) -> Decision:
        """A decision for `worker` with its per-block plan and cost estimate."""
        plan, estimate = plan_and_estimate(request, view, worker)
        return Decision(
            worker=worker.worker,
            plan=plan,
            estimate=estimate,
            reason=reason,
            dp_rank=worker.dp_rank,
        )

    def decide_at(
        self, request: Request, view: View, i: int, reason: str = "", *, with_pending: bool = False
    ) -> Decision:
        """`decide` for the view's `i`-th row, without making its `WorkerView` (what a
        router that scored the columns has: a position). `with_pending`: its blocks
        being computed count as held (speculative residency)."""
        plan, estimate = plan_and_estimate_at(request, view, i, with_pending=with_pending)
        c = view.columns
        return Decision(
            worker=int(c.worker[i]),
            plan=plan,
            estimate=estimate,
            reason=reason,
            dp_rank=int(c.dp_rank[i]),
        )


def estimate_ttft_s(request: Request, view: View, worker: WorkerView) -> float:
    """`plan_and_estimate(...)[1].ttft_s` without building the plan (for argmin loops)."""
    cost = view.cost
    n = len(request.content_keys)
    bs = view.block_size
    covered = min(worker.gpu_blocks, n)
    transfer_s = 0.0
    for tier, blocks in (("cpu", worker.cpu_blocks), ("disk", worker.disk_blocks)):
        blocks = min(blocks, n)
        if blocks > covered:
            transfer_s += cost.transfer_time(blocks - covered, tier)
            covered = blocks
    if cost.config.transfer.allow_peer_fetch:
        _, peer_blocks = view.best_peer_blocks(exclude=worker.worker)
        peer_blocks = min(peer_blocks, n)
        if peer_blocks > covered:
            peer_s = cost.transfer_time(peer_blocks - covered, "peer")
            if peer_s < cost.prefill_time((peer_blocks - covered) * bs, covered * bs):
                transfer_s += peer_s
                covered = peer_blocks
    new_tokens = max(request.prompt_tokens - min(covered * bs, request.prompt_tokens), 1)
    return (
        cost.queue_time(worker.queued_prefill_tokens, worker.queued_prefill_pairs)
        + transfer_s
        + cost.prefill_time(new_tokens, request.prompt_tokens - new_tokens)
    )


def peer_blocks_array(view: View) -> npt.NDArray[np.int64]:
    """Per row, `view.best_peer_blocks(exclude=worker)[1]`: the longest GPU prefix
    another worker holds."""
    c = view.columns
    gpu = c.gpu_blocks
    if len(gpu) < 2:
        return np.zeros(len(gpu), dtype=np.int64)
    first = int(np.argmax(gpu))
    # the rows of the leader's own engine (its other ranks) see the best elsewhere
    own = c.worker == c.worker[first]
    out = np.full(len(gpu), gpu[first], dtype=np.int64)
    out[own] = np.where(own, 0, gpu).max()
    return out


def covered_array(
    request: Request, view: View, gpu: npt.NDArray[np.int64]
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]:
    """Per worker, the blocks it can serve without recomputing given `gpu` (its usable
    GPU prefix, at most the request's blocks) and the transfer time that takes: local
    tiers beyond the GPU prefix, then a peer's GPU prefix where fetching beats
    recomputing, as `estimate_ttft_s` adds them one worker at a time."""
    cost = view.cost
    c = view.columns
    n = len(request.content_keys)
    bs = view.block_size
    covered = gpu
    transfer = np.zeros(len(gpu))
    for tier, blocks in (("cpu", c.cpu_blocks), ("disk", c.disk_blocks)):
        blocks = np.minimum(blocks, n)
        more = blocks > covered
        if more.any():
            transfer = np.where(
                more, transfer + cost.transfer_time_array(blocks - covered, tier), transfer
            )
            covered = np.where(more, blocks, covered)
    if cost.config.transfer.allow_peer_fetch:
        peer = np.minimum(peer_blocks_array(view), n)
        more = peer > covered
        if more.any():
            peer_s = cost.transfer_time_array(peer - covered, "peer")
            worth = more & (peer_s < cost.prefill_time_array((peer - covered) * bs, covered * bs))
            transfer = np.where(worth, transfer + peer_s, transfer)
            covered = np.where(worth, peer, covered)
    return covered, transfer


def estimate_ttft_s_array(request: Request, view: View) -> npt.NDArray[np.float64]:
    """`estimate_ttft_s` for every worker of the view at once (bit-identical)."""
    cost = view.cost
    c = view.columns
    bs = view.block_size
    prompt = request.prompt_tokens
    covered, transfer = covered_array(
        request, view, np.minimum(c.gpu_blocks, len(request.content_keys))
    )
    new = np.maximum(prompt - np.minimum(covered * bs, prompt), 1)
    return (
        cost.queue_time_array(c.queued_prefill_tokens, c.queued_prefill_pairs)
        + transfer
        + cost.prefill_time_array(new, prompt - new)
    )


def kernel_rows(
    view: View,
) -> tuple[
    npt.NDArray[np.uint64],
    npt.NDArray[np.float64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
    npt.NDArray[np.int64],
]:
    """The columns `CostModel.kernel` scores, in its argument order."""
    c = view.columns
    return (
        c.worker,
        np.ascontiguousarray(c.load),
        c.gpu_blocks,
        c.cpu_blocks,
        c.disk_blocks,
        c.pending_blocks,
    )


#: Floor rows a pruning router scores first (doubled while the last of them could tie).
PRUNE_FIRST_ROWS = 8


def pruned_lowest(
    view: View,
    fields: tuple[str, ...],
    score: Callable[[npt.NDArray[np.intp]], tuple[int, npt.NDArray[np.float64]]],
) -> int | None:
    """The position `score` would pick over every row, found by scoring only the rows
    above the floor and the least loaded rows by `fields` (`View.least_loaded`).

    `score(at)` scores the rows at positions `at` (ascending) and returns the position
    within `at` of its choice (the lowest score, ties by the router's own order) and
    the scores. Exact when the router's score of a row holding exactly the floor is
    non-decreasing along the order of `fields` (then worker id, rank): every row after
    the last one scored scores at least as much as it, so once that last score exceeds
    the choice's, no unscored row can win or tie. Otherwise twice as many rows are
    taken, up to all of them. None: the view is not prunable (score it whole)."""
    if not view.prunable:
        return None
    n = len(view)
    above = view.above_floor()
    if 2 * len(above) >= n:
        return None  # no floor to speak of (an engine holding nothing yet)
    # a handful of rows: Python's sets beat numpy's set operations here
    special = above.tolist()
    is_special = set(special)
    k = PRUNE_FIRST_ROWS
    while True:
        least = view.least_loaded(fields, k + len(special)).tolist()
        rows = sorted(is_special.union(least))
        if len(rows) >= n:
            return None  # every row: scoring them whole is the same and cheaper
        # more rows than are special were taken, and there are more rows than taken:
        # some rows taken hold only the floor
        last = bisect.bisect_left(rows, [p for p in least if p not in is_special][-1])
        choice, scores = score(np.asarray(rows, dtype=np.intp))
        if scores[last] > scores[choice]:
            return rows[choice]
        k *= 2


#: Up to this many rows, `first_min` compares them in Python.
_FEW_ROWS = 16


def first_min(*keys: npt.NDArray[np.generic]) -> int:
    """The position of the smallest row by `keys` compared in order (a tuple key), the
    first among equals: `min(range(n), key=lambda i: tuple(k[i] for k in keys))`."""
    if len(keys[0]) <= _FEW_ROWS:
        # that expression itself: numpy's per-call cost is more than a few rows' loop
        # (the same order: the values as Python numbers compare as numpy's do)
        columns = [k.tolist() for k in keys]
        if len(columns) == 1:
            first = columns[0]
            return min(range(len(first)), key=first.__getitem__)
        return min(range(len(columns[0])), key=lambda i: [c[i] for c in columns])
    at = np.flatnonzero(keys[0] == keys[0].min())
    for k in keys[1:]:
        if len(at) == 1:
            break
        sub = k[at]
        at = at[sub == sub.min()]
    return int(at[0])


def plan_and_estimate(
    request: Request, view: View, worker: WorkerView
) -> tuple[tuple[PlanStep, ...], Estimate]:
    """Reuse the GPU prefix, fetch what a local tier (or, if allowed, a peer) holds
    beyond it, recompute the rest; estimate TTFT and TBT with the view's cost model, on
    an engine `worker.pace` times slower than the fleet (a transfer is not slower)."""
    return _plan(
        request,
        view,
        worker.worker,
        worker.gpu_blocks,
        worker.cpu_blocks,
        worker.disk_blocks,
        worker.queued_prefill_tokens,
        worker.queued_prefill_pairs,
        worker.running_decodes,
        worker.mean_context_tokens,
        worker.pace,
    )


def plan_and_estimate_at(
    request: Request, view: View, i: int, *, with_pending: bool = False
) -> tuple[tuple[PlanStep, ...], Estimate]:
    """`plan_and_estimate` for the view's `i`-th row, read from the columns (no
    `WorkerView` made); `with_pending`: the blocks being computed there count as held
    on its GPU (speculative residency)."""
    c = view.columns
    gpu = int(c.gpu_blocks[i])
    if with_pending:
        gpu = max(gpu, int(c.pending_blocks[i]))
    _, queued, decodes, _, mean_context, pairs = c.load[i].tolist()
    return _plan(
        request,
        view,
        int(c.worker[i]),
        gpu,
        int(c.cpu_blocks[i]),
        int(c.disk_blocks[i]),
        as_count(queued),
        pairs,
        as_count(decodes),
        mean_context,
        float(c.fleet[i, PACE_COLUMN]),
    )


def _plan(
    request: Request,
    view: View,
    worker: int,
    gpu_blocks: int,
    cpu_blocks: int,
    disk_blocks: int,
    queued_prefill_tokens: Any,
    queued_prefill_pairs: float,
    running_decodes: Any,
    mean_context_tokens: float,
    pace: float,
) -> tuple[tuple[PlanStep, ...], Estimate]:
    cost = view.cost
    n = len(request.content_keys)
    bs = view.block_size
    steps: list[PlanStep] = []
    reuse = min(gpu_blocks, n)
    if reuse:
        steps.append(PlanStep(Action.REUSE, 0, reuse))
    covered = reuse
    transfer_s = 0.0
    for tier, blocks in (("cpu", cpu_blocks), ("disk", disk_blocks)):
        blocks = min(blocks, n)
        if blocks > covered:
            steps.append(PlanStep(Action.FETCH_TIER, covered, blocks, tier))
            transfer_s += cost.transfer_time(blocks - covered, tier)
            covered = blocks
    if cost.config.transfer.allow_peer_fetch:
        peer, peer_blocks = view.best_peer_blocks(exclude=worker)
        peer_blocks = min(peer_blocks, n)
        if peer is not None and peer_blocks > covered:
            peer_s = cost.transfer_time(peer_blocks - covered, "peer")
            # Fetch only when moving the blocks beats recomputing them.
            if peer_s < cost.prefill_time((peer_blocks - covered) * bs, covered * bs):
                steps.append(PlanStep(Action.FETCH_PEER, covered, peer_blocks, f"worker:{peer}"))
                transfer_s += peer_s
                covered = peer_blocks
    if covered < n:
        steps.append(PlanStep(Action.RECOMPUTE, covered, n))
    cached_tokens = min(covered * bs, request.prompt_tokens)
    new_tokens = max(request.prompt_tokens - cached_tokens, 1)
    # (pace 1.0 multiplies exactly)
    estimate = Estimate(
        queue_s=pace * cost.queue_time(queued_prefill_tokens, queued_prefill_pairs),
        transfer_s=transfer_s,
        prefill_s=pace * cost.prefill_time(new_tokens, request.prompt_tokens - new_tokens),
        tbt_s=pace
        * cost.decode_step_time(
            running_decodes + 1,
            (mean_context_tokens * running_decodes + request.prompt_tokens) / (running_decodes + 1),
        ),
    )
    return tuple(steps), estimate
