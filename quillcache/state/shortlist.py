"""The shortlist a replica books through Redis, built from its router's decision and the
view the router saw (docs/state.md, "How the gateway uses it").

Order: the router's choice first, then up to `size - 1` other rows of the view, those
holding (or computing) the longest prefix of the request first, then the least loaded.

Ceilings (the load, in `LoadWeights` units, at or above which a candidate stops being
preferred) are derived from what this replica *saw* when it decided:

    the router's choice:  ceiling = seen + 1 + cache_slack * min(prefix_blocks / request_blocks, 1)
    any other candidate:  ceiling = min(seen, seen of the choice) + 1 + cache_slack * (...)

`seen` is a candidate's load in the view: the fleet's booked load at the last poll of
Redis, moved by this replica's own bookings since. So the choice stays preferred while
at most one request more than this replica counted has landed on it, plus up to
`cache_slack` more when it holds the request's whole prefix (in proportion to the part
it holds): a cached prefix is worth some queueing, a cold engine is not. Another
candidate is preferred instead only while its load is below what the choice had when
the router chose it; and when every candidate is at or over its ceiling, the least
overshoot wins, which for cold candidates is the least load the fleet really has.

Why this spreads a burst: replicas that decide within one poll interval all saw the
same loads and pick the same engine. The script books them one at a time; the first
finds the engine under its ceiling, the next finds it at `seen + 1` and takes the next
candidate still under its own, and once every candidate is at its ceiling the least
overshoot wins, which turns into round-robin over the shortlist. What one gateway does
when it sees every booking at once, without waiting for a poll.

Engines outside the list (`Shortlist.outside`, `OutsideTerms`): the booking also weighs
the engine the request's session is bound to and those computing a part of its prefix
when the list does not name them (the bindings and placements of other replicas are in
Redis, not in this replica's view). Derived lists weigh them as a listed candidate
other than the choice: ceiling `seen of the choice + 1`, credit `cache_slack` (so a
bound engine, taken as holding the session's prefix, gets `seen of the choice + 1 +
cache_slack`); a router's own list as its choice holding none of the prefix, with the
choice's credit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache.errors import ConfigError
from quillcache.routing.shortlist import Preference
from quillcache.routing.types import View
from quillcache.state.types import (
    TAIL_FP_CHARS,
    TAIL_MAX_BLOCKS,
    Anchor,
    Candidate,
    EngineKey,
    LoadWeights,
    OutsideTerms,
)


@dataclass(frozen=True, slots=True)
class ShortlistPolicy:
    """How long a shortlist is and how its ceilings are derived (module docstring)."""

    size: int = 4
    cache_slack: float = 4.0
    weights: LoadWeights = field(default_factory=LoadWeights)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"shortlist size must be >= 1, got {self.size}")
        if not math.isfinite(self.cache_slack) or self.cache_slack < 0:
            raise ConfigError(f"cache_slack must be finite and >= 0, got {self.cache_slack}")


@dataclass(frozen=True, slots=True)
class Shortlist:
    """The candidates, and per candidate the prefix blocks the view says it holds or is
    computing (what the request reuses if it is booked there)."""

    candidates: list[Candidate]
    cached_blocks: list[int]
    # what an engine outside the list, bound to the request's session or computing its
    # prefix, is worth to the booking (None: nothing; docs/state.md, "Outside the
    # shortlist")
    outside: OutsideTerms | None = None


# Up to this many rows, the shortlist is built from Python lists (one `tolist` per
# column): numpy's per-call cost on a few rows is many times the arithmetic.
SMALL_VIEW = 64


def build_shortlist(
    view: View,
    worker: int,
    dp_rank: int,
    request_blocks: int,
    policy: ShortlistPolicy,
) -> Shortlist:
    """The shortlist of a request the router sent to (`worker`, `dp_rank`) in `view`.
    The choice is always first, even when it is not a row of the view (a router may
    route outside the columns it read; the plane checked the worker is a candidate).
    The other rows: longest prefix first, then least loaded, then view order."""
    c = view.columns
    n = len(c.worker)
    w = policy.weights
    scores: list[float]
    cached: list[int]
    if n <= SMALL_VIEW:
        scores = [
            w.in_flight * a + w.queued_tokens * b + w.decodes * d
            for a, b, d in c.load[:, :3].tolist()
        ]
        cached = [
            max(x, y)
            for x, y in zip(c.local_blocks.tolist(), c.pending_blocks.tolist(), strict=True)
        ]
        workers, ranks = c.worker.tolist(), c.dp_rank.tolist()
        chosen = next((i for i in range(n) if workers[i] == worker and ranks[i] == dp_rank), -1)
        rows = _others_small(scores, cached, chosen, policy.size - 1)
    else:
        load = c.load
        score_arr: npt.NDArray[np.float64] = (
            w.in_flight * load[:, 0] + w.queued_tokens * load[:, 1] + w.decodes * load[:, 2]
        )
        cached_arr = np.maximum(c.local_blocks, c.pending_blocks)
        hit = np.flatnonzero((c.worker == np.uint64(worker)) & (c.dp_rank == dp_rank))
        chosen = int(hit[0]) if len(hit) else -1
        rows = _others(score_arr, cached_arr, chosen, policy.size - 1)
        scores, cached = score_arr.tolist(), cached_arr.tolist()
        workers, ranks = c.worker.tolist(), c.dp_rank.tolist()
    out: list[Candidate] = []
    blocks: list[int] = []
    denom = max(request_blocks, 1)
    if chosen < 0:
        out.append(Candidate(EngineKey(worker, dp_rank), math.inf))
        blocks.append(0)
    else:
        rows = [chosen, *rows]
    chosen_seen = float(scores[chosen]) if chosen >= 0 else math.inf
    for r in rows:
        b = int(cached[r])
        seen = float(scores[r]) if r == chosen else min(float(scores[r]), chosen_seen)
        ceiling = seen + 1.0 + policy.cache_slack * min(b / denom, 1.0)
        out.append(Candidate(EngineKey(int(workers[r]), int(ranks[r])), ceiling))
        blocks.append(b)
    # an unlisted engine is weighed as a listed one that is not the choice, seen at
    # its load now: holding or computing the whole prefix buys `cache_slack`
    outside = OutsideTerms(chosen_seen + 1.0, policy.cache_slack) if chosen >= 0 else None
    return Shortlist(out, blocks, outside)


def shortlist_of(
    view: View,
    preferences: list[Preference],
    request_blocks: int,
    prompt_tokens: int,
    block_size: int,
    weights: LoadWeights,
) -> Shortlist:
    """A router's own shortlist (`Router.shortlist`, checked) in load units: a row's
    ceiling is its load in the view plus its `requests` times the load one request like
    this one adds there (`LoadWeights` of one request in flight with its prefill
    queued), its credit `pending_requests` times the load of one whose prefix is
    computed. The native kernel's (`CostKernel.load_units`); `reference_shortlist_of`
    is the readable reference it translates."""
    c = view.columns
    workers, ranks, ceilings, credits, held, outside = view.cost.kernel.load_units(
        c.worker,
        c.dp_rank,
        np.ascontiguousarray(c.load),
        c.gpu_blocks,
        c.cpu_blocks,
        c.disk_blocks,
        c.pending_blocks,
        [p.position for p in preferences],
        [p.requests for p in preferences],
        [p.pending_requests for p in preferences],
        (weights.in_flight, weights.queued_tokens, weights.decodes),
        prompt_tokens,
        request_blocks,
        block_size,
    )
    out = [
        Candidate(EngineKey(w, r), ceiling, credit)
        for w, r, ceiling, credit in zip(workers, ranks, ceilings, credits, strict=True)
    ]
    return Shortlist(out, held, None if outside is None else OutsideTerms(*outside))


def reference_shortlist_of(
    view: View,
    preferences: list[Preference],
    request_blocks: int,
    prompt_tokens: int,
    block_size: int,
    weights: LoadWeights,
) -> Shortlist:
    """`shortlist_of` in Python and numpy, the reference."""
    c = view.columns
    rows = [p.position for p in preferences]
    load = c.load[rows, :3].tolist()
    held = [
        max(g, cpu, disk, pend)
        for g, cpu, disk, pend in zip(
            c.gpu_blocks[rows].tolist(),
            c.cpu_blocks[rows].tolist(),
            c.disk_blocks[rows].tolist(),
            c.pending_blocks[rows].tolist(),
            strict=True,
        )
    ]
    workers, ranks = c.worker[rows].tolist(), c.dp_rank[rows].tolist()
    w_n, w_q, w_d = weights.in_flight, weights.queued_tokens, weights.decodes
    hit_unit = w_n + w_q * prefill_tokens(prompt_tokens, request_blocks, block_size)
    cold_unit = w_n + w_q * prefill_tokens(prompt_tokens, 0, block_size)
    out: list[Candidate] = []
    outside: OutsideTerms | None = None
    for p, (a, b, d), h, worker, rank in zip(preferences, load, held, workers, ranks, strict=True):
        seen = w_n * a + w_q * b + w_d * d
        unit = w_n + w_q * prefill_tokens(prompt_tokens, min(h, request_blocks), block_size)
        credit = p.pending_requests * hit_unit
        out.append(Candidate(EngineKey(worker, rank), seen + p.requests * unit, credit))
        if outside is None:
            # an unlisted engine is worth what the router's choice is worth holding
            # none of the prefix, and its credit for a prefix held or being computed
            outside = OutsideTerms(seen + p.requests * cold_unit, credit)
    return Shortlist(out, held, outside)


def _others_small(scores: list[float], cached: list[int], chosen: int, want: int) -> list[int]:
    """Up to `want` rows other than `chosen`: by sort key (the load, less the top load
    per cached block: longest prefix first, then least loaded), then view order."""
    n = len(scores)
    if want <= 0 or n <= (1 if chosen >= 0 else 0):
        return []
    top = max(scores) + 1.0
    keyed = sorted((scores[i] - float(cached[i]) * top, i) for i in range(n) if i != chosen)
    return [i for _, i in keyed[:want]]


def _others(
    scores: npt.NDArray[np.float64], cached: npt.NDArray[Any], chosen: int, want: int
) -> list[int]:
    """`_others_small` over numpy columns (large views): the same rows, in the same
    order."""
    n = len(scores)
    if want <= 0 or n <= (1 if chosen >= 0 else 0):
        return []
    top = float(scores.max()) + 1.0
    key = scores - cached.astype(np.float64) * top
    if chosen >= 0:
        key[chosen] = np.inf
    k = min(want, n - (1 if chosen >= 0 else 0))
    if k < n:
        # the k-th smallest key and every row below it, ties included, then sorted by
        # (key, row): argpartition alone may keep any of several tied rows
        kth = np.partition(key, k - 1)[k - 1]
        part = np.flatnonzero(key <= kth)
    else:
        part = np.arange(n)
    part = part[np.lexsort((part, key[part]))][:k]
    return [int(r) for r in part if r != chosen]


def anchors(keys: npt.NDArray[np.uint64]) -> list[Anchor]:
    """The anchors a booking records and looks up (docs/state.md, "Anchors"): the key at
    each power-of-two block count up to the request's length, and the last one; each
    with the fingerprints of the blocks up to the next (`Anchor.tail`)."""
    n = len(keys)
    depths: list[int] = []
    b = 1
    while b < n:
        depths.append(b)
        b *= 2
    if n:
        depths.append(n)
    # each key's low bits, big-endian: its bytes in hex are the fingerprints, in order
    fps = np.asarray(keys, dtype=np.uint64).astype(f">u{TAIL_FP_CHARS // 2}")
    out: list[Anchor] = []
    for i, d in enumerate(depths):
        upto = min(depths[i + 1] if i + 1 < len(depths) else d, d + TAIL_MAX_BLOCKS)
        out.append(Anchor(int(keys[d - 1]), d, fps[d:upto].tobytes().hex()))
    return out


def prefill_tokens(prompt_tokens: int, cached_blocks: int, block_size: int) -> int:
    """What the plane books as a request's prefill: its tokens not cached (at least 1)."""
    return max(prompt_tokens - cached_blocks * block_size, 1)
