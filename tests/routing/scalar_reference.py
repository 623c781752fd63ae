"""The built-in routers' choices written as plain loops over `view.workers`, one
worker at a time: the reference the column-scoring routers are compared against
(`test_columns.py`). Each takes the router (for its parameters and its random
generator) and returns the chosen worker's id."""

from __future__ import annotations

import bisect
import math

import xxhash

from quillcache.routing import Request, Router, View, WorkerView
from quillcache.routing.base import estimate_ttft_s
from quillcache.routing.baselines import (
    LeastLoaded,
    PowerOfTwo,
    RandomRouter,
    RoundRobin,
    SessionAffinity,
)
from quillcache.routing.dynamo import DynamoKvCost
from quillcache.routing.llmd import LlmdPrecisePrefix
from quillcache.routing.preble import PrebleE2
from quillcache.routing.quill import QuillCacheRouter
from quillcache.routing.sglang import SglangCacheAware


def load_key(w: WorkerView) -> tuple[int, int, int]:
    return (w.in_flight, w.queued_prefill_tokens, w.worker)


def round_robin(r: RoundRobin, request: Request, view: View, turn: int) -> int:
    return view.workers[turn % len(view.workers)].worker


def random_choice(r: RandomRouter, request: Request, view: View, turn: int) -> int:
    return r.rng.choice(view.workers).worker


def least_loaded(r: LeastLoaded, request: Request, view: View, turn: int) -> int:
    return min(view.workers, key=load_key).worker


def power_of_two(r: PowerOfTwo, request: Request, view: View, turn: int) -> int:
    if len(view.workers) == 1:
        return view.workers[0].worker
    a, b = r.rng.sample(view.workers, 2)
    return min(a, b, key=load_key).worker


def session_affinity(r: SessionAffinity, request: Request, view: View, turn: int) -> int:
    ring = sorted(
        (xxhash.xxh3_64_intdigest(f"{w.worker}#{v}".encode()), w.worker)
        for w in view.workers
        for v in range(r.vnodes)
    )
    points = [p for p, _ in ring]
    if request.session_id is not None:
        h = xxhash.xxh3_64_intdigest(str(request.session_id).encode())
    elif len(request.content_keys):
        h = int(request.content_keys[min(len(request.content_keys), r.prefix_blocks) - 1])
    else:
        h = xxhash.xxh3_64_intdigest(str(request.request_id).encode())
    return ring[bisect.bisect_left(points, h) % len(points)][1]


def dynamo(r: DynamoKvCost, request: Request, view: View, turn: int) -> int:
    bs = view.block_size
    n = len(request.content_keys)
    least_queued = min(w.queued_prefill_tokens for w in view.workers)
    costs = []
    for w in view.workers:
        device = w.gpu_blocks
        host = max(w.cpu_blocks - device, 0)
        disk = max(w.disk_blocks - max(device, w.cpu_blocks), 0)
        credit = r.overlap_score_credit
        if r.overlap_score_credit_decay > 0:
            request_blocks = max(-(-request.prompt_tokens // bs), 1)
            backlog = (w.queued_prefill_tokens - least_queued) / bs / request_blocks
            credit = r.overlap_score_credit / (1.0 + r.overlap_score_credit_decay * backlog)
        overlap = credit * device + r.host_cache_hit_weight * host + r.disk_cache_hit_weight * disk
        raw_prefill = (w.queued_prefill_tokens + request.prompt_tokens) / bs
        shared = min(max(device, w.pending_blocks), n)
        decode = w.kv_usage * w.capacity_blocks + (n - shared)
        costs.append(
            r.prefill_load_scale * max(raw_prefill - overlap, 0.0)
            + decode
            + r.active_request_weight * w.in_flight
        )
    if r.temperature <= 0:
        best = min(costs)
        ties = [w for w, c in zip(view.workers, costs, strict=True) if c == best]
        return (ties[0] if len(ties) == 1 else r.rng.choice(ties)).worker
    lo, hi = min(costs), max(costs)
    if lo == hi:
        weights = [1.0] * len(costs)
    else:
        weights = [math.exp(-(c - lo) / ((hi - lo) * r.temperature)) for c in costs]
    return r.rng.choices(view.workers, weights=weights)[0].worker


def llmd(r: LlmdPrecisePrefix, request: Request, view: View, turn: int) -> int:
    wp, wq, wk = r.weights
    tg, tc = r.tiers
    hits = []
    for w in view.workers:
        lower = max(w.cpu_blocks, w.disk_blocks) - w.gpu_blocks
        hits.append(tg * w.gpu_blocks + tc * max(lower, 0))
    held = [h for h in hits if h > 0]
    hlo, hhi = (min(held), max(held)) if held else (0.0, 0.0)
    queues = [w.in_flight for w in view.workers]
    qlo, qhi = min(queues), max(queues)
    best_score, best = -1.0, []
    for w, h in zip(view.workers, hits, strict=True):
        if h <= 0:
            prefix = 0.0
        elif hlo == hhi:
            prefix = 1.0
        else:
            prefix = (h - hlo) / (hhi - hlo)
        queue = 1.0 if qhi == qlo else (qhi - w.in_flight) / (qhi - qlo)
        score = wp * prefix + wq * queue + wk * (1.0 - w.kv_usage)
        if score > best_score + 1e-12:
            best_score, best = score, [w]
        elif abs(score - best_score) <= 1e-12:
            best.append(w)
    return (best[0] if len(best) == 1 else r.rng.choice(best)).worker


def sglang(r: SglangCacheAware, request: Request, view: View, turn: int) -> int:
    workers = view.workers
    loads = [w.in_flight for w in workers]
    lo, hi = min(loads), max(loads)
    if hi - lo > r.balance_abs_threshold and hi > lo * r.balance_rel_threshold:
        return min(workers, key=lambda w: (w.in_flight, w.worker)).worker
    best = max(
        workers, key=lambda w: (max(w.gpu_blocks, w.pending_blocks), -w.in_flight, -w.worker)
    )
    held = max(best.gpu_blocks, best.pending_blocks)
    if held * view.block_size / max(request.prompt_tokens, 1) > r.cache_threshold:
        return best.worker
    return min(workers, key=lambda w: (w.resident_blocks, w.in_flight, w.worker)).worker


def quill(r: QuillCacheRouter, request: Request, view: View, turn: int) -> int:
    """QuillCacheRouter.route as a loop: per-request state, then `estimate_s` per worker."""
    if view.order_only:
        bs, n = view.block_size, len(request.content_keys)
        return max(
            view.workers,
            key=lambda w: (
                min(w.local_blocks, n) * bs - r.pressure_weight * w.queued_prefill_tokens,
                -w.in_flight,
                -w.worker,
            ),
        ).worker
    workers = view.workers
    r._lambda = r.work_weight
    r._mean_decodes = sum(w.running_decodes for w in workers) / len(workers)
    if r.adaptive and r.work_scope == "cluster":
        waiting = sum(max(w.in_flight - w.running_decodes, 0) for w in workers)
        r._lambda = min(r._lambda * (r.work_base + waiting / len(workers)), r.max_work_weight)
    sid = str(request.session_id) if request.session_id is not None else None
    r._continuing = False
    r._session_kv_tokens = {}
    if r.sessions and sid is not None:
        homes, live = r._homes, r._live
        horizon = view.now_s - r.session_ttl_s
        while homes:
            old, (worker, seen) = next(iter(homes.items()))
            if seen >= horizon:
                break
            del homes[old]
            live[worker] -= 1
        home = homes.pop(sid, None)
        if home is not None:
            live[home[0]] -= 1
            r._continuing = view.now_s - home[1] >= r.concurrent_session_s
        else:
            total = sum(live.get(w.worker, 0) for w in workers)
            if total:
                kv = math.fsum(w.running_decodes * w.mean_context_tokens for w in workers)
                r._session_kv_tokens = {
                    w.worker: live.get(w.worker, 0) * (kv / total) for w in workers
                }
    best = min(
        workers,
        key=lambda w: (
            r.estimate_s(request, view, w),
            -max(w.local_blocks, w.pending_blocks),
            w.in_flight,
            w.worker,
        ),
    )
    if r.sessions and sid is not None:
        r._homes[sid] = (best.worker, view.now_s)
        r._live[best.worker] = r._live.get(best.worker, 0) + 1
    return best.worker


def ttft_argmin(r: Router, request: Request, view: View, turn: int) -> int:
    """mooncake (alias quillcache-greedy): the lowest estimated TTFT."""
    return min(
        view.workers,
        key=lambda w: (estimate_ttft_s(request, view, w), -w.local_blocks, w.in_flight, w.worker),
    ).worker


def preble(r: PrebleE2, request: Request, view: View, turn: int) -> int:
    bs = view.block_size
    best = max(view.workers, key=lambda w: (w.gpu_blocks, -w.in_flight, -w.worker))
    matched = best.gpu_blocks * bs
    if matched > request.prompt_tokens - matched:
        return best.worker
    cost = view.cost

    def total(w: WorkerView) -> tuple[float, int]:
        new_tokens = max(request.prompt_tokens - w.gpu_blocks * bs, 1)
        load = cost.queue_time(
            w.queued_prefill_tokens, w.queued_prefill_pairs
        ) + w.running_decodes * (
            cost.decode_step_time(max(w.running_decodes, 1), w.mean_context_tokens)
            / max(w.running_decodes, 1)
        )
        free = w.capacity_blocks * (1.0 - w.kv_usage)
        evict_blocks = max(-(-new_tokens // bs) - free, 0.0)
        evict = cost.prefill_time(int(evict_blocks * bs)) if evict_blocks else 0.0
        return (
            load + cost.prefill_time(new_tokens, request.prompt_tokens - new_tokens) + evict,
            w.worker,
        )

    return min(view.workers, key=total).worker
