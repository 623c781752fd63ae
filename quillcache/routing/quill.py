"""QuillCache's own policy ("quillcache"): estimated-TTFT argmin plus the cost a choice
imposes on everybody else, with sessions as long-lived load.

Timed operation (the score of each worker; the lowest wins):

1. speculative residency: blocks being computed right now for an earlier request on a
   worker (`WorkerView.pending_blocks`, from the control plane) count as reusable
   there, since their compute is already in that worker's queue;
2. decode interference: the queue estimate charges every prefill step with the
   running decodes' budget share and KV reads (`CostModel.loaded_prefill_time`);
3. the prefill work a choice adds, weighted by how many requests wait behind it;
4. decode pile-up: the delay its KV reads impose on the decodes a worker runs above
   the cluster mean, for the steps they still overlap once its prefill is done (a
   long prompt starts decoding after today's decodes have finished);
5. sequence slots: an engine runs at most `max_num_seqs` sequences; with every slot
   taken, a request waits for decodes to finish before its prefill starts
   (`CostModel.slot_wait_time_array`), which a queue of prefill tokens does not show;
6. engine pace: an engine the control plane found slower than the fleet's median
   (`WorkerView.pace`, learned from observed TTFT: controlplane/pace.py) has every term
   it computes or reads (queue, prefill, slot wait, decode steps) that many times longer;
   a transfer is not;
7. sessions (requests with a session id): a session's next turns come back to the
   worker holding its history, so a *new* session chooses a home for all of them: it
   also weighs the decode batch it will join there, estimated from the live sessions
   homed on each worker (each bringing the fleet's decodes per live session, at the
   fleet's mean decode context: an engine whose sessions are between turns, or still
   queued for their prefill, decodes nothing right now but will). A continuing session
   is not moved for decode balance (its home was chosen for that); only its TTFT and
   the work it adds count (`continuing_work_weight` scales that work term; 0 = move
   whenever the queue at home outweighs the recompute elsewhere, which scatters agent
   fan-out calls: see docs/simulator.md). A request of a session routed less than
   `concurrent_session_s` after the session's previous one is not a turn but runs
   beside it (an agent's parallel calls, many users behind one id): it is scored as a
   lone request, decode balance included, or every such request piles onto the
   session's engine;
8. the cache a choice pushes out: the blocks a request places on an engine beyond its
   free blocks (capacity minus resident, where both are known) evict cached ones, each
   recomputed if it is needed again: `evict_weight` (the chance it would be) x their
   prefill. Without it, an engine that has never served a request lacks even a block
   every request shares (the Mooncake trace's first block), so at light load it is
   never chosen while one that has it is free, and the engines in use evict prefixes
   their follow-ups would reuse while others' caches stay empty. Off by default (0):
   it wins that time to first token back but costs end-to-end latency, more the
   larger the weight (docs/routing.md, docs/results/simulator.md).

Order-only replay (`View.order_only`: no time, load fields are a proxy of recent
assignments): nothing to trade latency against, so it makes the cache-optimal choice:
the most reused tokens minus `pressure_weight` x the tokens each worker was recently
given (the blocks a worker received lately sit at its LRU tail, so placing more there
evicts younger, likelier-to-be-reused blocks).

Ties go to the longer reusable prefix, then to fewer requests in flight.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache._native import QuillSettings
from quillcache.errors import ConfigError
from quillcache.routing.base import Router, covered_array, first_min, kernel_rows
from quillcache.routing.shortlist import Preference, cost_preferences
from quillcache.routing.types import Decision, Request, View, WorkerView


class QuillCacheRouter(Router):
    name = "quillcache"
    summary = "TTFT argmin + the work and decode load it adds; sessions choose a home"
    source = "QuillCache (this project); see docs/routing.md"
    prunes = True  # `chosen` walks the rows by queue until a bound rules out the rest

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
        sessions: bool = True,
        session_ttl_s: float = 45.0,
        home_decode_weight: float = 1.0,
        pressure_weight: float = 0.02,
        continuing_work_weight: float = 1.0,
        concurrent_session_s: float = 0.1,
        evict_weight: float = 0.0,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if work_scope not in ("cluster", "worker"):
            raise ConfigError(f"work_scope must be 'cluster' or 'worker', got {work_scope!r}")
        if continuing_work_weight < 0:
            raise ConfigError(f"continuing_work_weight must be >= 0, got {continuing_work_weight}")
        if session_ttl_s <= 0:
            raise ConfigError(f"session_ttl_s must be positive, got {session_ttl_s}")
        if not concurrent_session_s >= 0:
            raise ConfigError(f"concurrent_session_s must be >= 0, got {concurrent_session_s}")
        if not (evict_weight >= 0 and math.isfinite(evict_weight)):
            raise ConfigError(f"evict_weight must be >= 0 and finite, got {evict_weight}")
        self.speculative = speculative
        self.interference = interference
        self.work_weight = work_weight
        self.adaptive = adaptive
        self.max_work_weight = max_work_weight
        self.work_scope = work_scope
        self.work_base = work_base
        self.decode_weight = decode_weight
        self.sessions = sessions
        self.session_ttl_s = session_ttl_s
        self.concurrent_session_s = concurrent_session_s
        self.home_decode_weight = home_decode_weight
        self.pressure_weight = pressure_weight
        self.continuing_work_weight = continuing_work_weight
        self.evict_weight = evict_weight
        # the knobs the native kernel reads, fixed from here on
        self._settings = QuillSettings(
            speculative=speculative,
            interference=interference,
            work_weight=work_weight,
            per_worker_lambda=adaptive and work_scope == "worker",
            work_base=work_base,
            max_work_weight=max_work_weight,
            continuing_work_weight=continuing_work_weight,
            decode_weight=decode_weight,
            home_decode_weight=home_decode_weight,
            evict_weight=evict_weight,
        )
        # per-request state, set by `route` before scoring
        self._lambda = work_weight
        self._mean_decodes = 0.0
        self._continuing = False  # a session seen within the TTL
        # worker -> KV tokens its sessions' decodes read each step (a new session's home)
        self._session_kv_tokens: dict[int, float] = {}
        # session id -> (worker it was last sent to, when), least recently seen first
        self._homes: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._live: dict[int, int] = {}  # worker -> live sessions homed there
        # request id -> (the session its children join, the worker it went to), the
        # latest `PARENTS_REMEMBERED`: what a parent hint (`Request.parent_id`) names
        self._placed: OrderedDict[int | str, tuple[str, int]] = OrderedDict()
        # the scores `route` computed for its last (request, view), which `shortlist`,
        # called right after it with the same two, reads instead of scoring again
        self._last_scores: tuple[Request, View, npt.NDArray[np.float64]] | None = None

    def estimate_s(self, request: Request, view: View, w: WorkerView) -> float:
        """One worker's score, the formula written out; `route` scores every worker at
        once with the same operations (`estimates`), after setting the per-request
        state this reads."""
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
        pace = w.pace  # what the engine computes or reads takes this many times longer
        extra = 0.0
        if self.work_weight:
            # the compute this request adds delays everyone queued after it there
            lam = self._lambda
            if self.adaptive and self.work_scope == "worker":
                waiting = max(w.in_flight - w.running_decodes, 0)
                lam = min(self.work_weight * (self.work_base + waiting), self.max_work_weight)
            if self._continuing:
                lam *= self.continuing_work_weight
            extra += lam * (pace * cost.prefill_compute_s(new, request.prompt_tokens - new))
        if self.interference:
            ttft = transfer_s + pace * cost.loaded_prefill_time(
                queued_tokens=w.queued_prefill_tokens,
                queued_pairs=w.queued_prefill_pairs,
                new_tokens=new,
                context_tokens=request.prompt_tokens - new,
                running_decodes=w.running_decodes,
                mean_context_tokens=w.mean_context_tokens,
            )
        else:
            ttft = (
                transfer_s
                + pace * cost.queue_time(w.queued_prefill_tokens, w.queued_prefill_pairs)
                + pace * cost.prefill_time(new, request.prompt_tokens - new)
            )
        out = request.expected_output_tokens
        # a request waits for a sequence slot when every one is taken
        ttft = ttft + pace * cost.slot_wait_time(
            w.in_flight, w.running_decodes, w.mean_context_tokens, out, w.max_num_seqs
        )
        excess = w.running_decodes - self._mean_decodes
        if self.decode_weight and excess > 0 and not self._continuing:
            # Its KV is read by every step while it decodes, so each co-running decode's
            # tokens come that much later; counted only for the decodes above the
            # cluster mean (piling onto one worker), where going elsewhere avoids it,
            # and only for the steps they still overlap once its prefill is done
            # (their remaining output taken to be about its own).
            step = pace * cost.decode_step_time(w.running_decodes, w.mean_context_tokens)
            overlap = max(out - ttft / step, 0.0) if step > 0 else out
            extra += (
                self.decode_weight
                * excess
                * overlap
                * (pace * cost.kv_read_s(request.prompt_tokens + out / 2))
            )
        if self.home_decode_weight and self._session_kv_tokens:
            # A new session's home: every turn decodes in the batch its sessions make,
            # each step reading their KV.
            batch = self._session_kv_tokens.get(w.worker, 0.0)
            extra += self.home_decode_weight * out * (pace * cost.kv_read_s(batch))
        if self.evict_weight:
            # the blocks it places beyond the free ones push cached blocks out
            free = (
                w.capacity_blocks - w.resident_blocks
                if w.capacity_blocks > 0 and w.residency_known
                else math.inf
            )
            evicted = max((n - gpu) - free, 0.0)
            extra += self.evict_weight * evicted * cost.prefill_compute_s(bs, 0)
        return extra + ttft

    def estimates(self, request: Request, view: View) -> npt.NDArray[np.float64]:
        """`estimate_s` for every worker of the view, bit for bit."""
        cost = view.cost
        c = view.columns
        bs = view.block_size
        n = len(request.content_keys)
        prompt = request.prompt_tokens
        gpu = c.gpu_blocks
        if self.speculative:
            gpu = np.maximum(gpu, c.pending_blocks)
        covered, transfer = covered_array(request, view, np.minimum(gpu, n))
        new = np.maximum(prompt - np.minimum(covered * bs, prompt), 1)
        decodes = c.running_decodes
        mean_context = c.mean_context_tokens
        pace = c.pace
        extra: npt.NDArray[np.float64] = np.zeros(len(c.worker))
        if self.work_weight:
            lam: float | npt.NDArray[np.float64] = self._lambda
            if self.adaptive and self.work_scope == "worker":
                waiting = np.maximum(c.in_flight - decodes, 0)
                lam = np.minimum(
                    self.work_weight * (self.work_base + waiting), self.max_work_weight
                )
            if self._continuing:
                lam = lam * self.continuing_work_weight
            extra = extra + lam * (pace * cost.prefill_compute_s_array(new, prompt - new))
        if self.interference:
            ttft = transfer + pace * cost.loaded_prefill_time_array(
                queued_tokens=c.queued_prefill_tokens,
                queued_pairs=c.queued_prefill_pairs,
                new_tokens=new,
                context_tokens=prompt - new,
                running_decodes=decodes,
                mean_context_tokens=mean_context,
            )
        else:
            ttft = (
                transfer
                + pace * cost.queue_time_array(c.queued_prefill_tokens, c.queued_prefill_pairs)
                + pace * cost.prefill_time_array(new, prompt - new)
            )
        out = request.expected_output_tokens
        slots = c.max_num_seqs if c.slotted else None
        ttft = ttft + pace * cost.slot_wait_time_array(
            c.in_flight, decodes, mean_context, out, slots
        )
        excess = decodes - self._mean_decodes
        if self.decode_weight and not self._continuing:
            piling = excess > 0
            if piling.any():
                step = pace * cost.decode_step_time_array(decodes, mean_context)
                with np.errstate(divide="ignore", invalid="ignore"):
                    overlap = np.where(step > 0, np.maximum(out - ttft / step, 0.0), out)
                term = (
                    self.decode_weight
                    * excess
                    * overlap
                    * (pace * cost.kv_read_s(prompt + out / 2))
                )
                extra = np.where(piling, extra + term, extra)
        if self.home_decode_weight and self._session_kv_tokens:
            homes = self._session_kv_tokens
            batch = np.asarray([homes.get(w, 0.0) for w in c.worker.tolist()])
            extra = extra + self.home_decode_weight * out * (pace * cost.kv_read_s_array(batch))
        if self.evict_weight:
            capacity = c.capacity_blocks
            known = (capacity > 0) & c.residency_known
            free = np.where(known, capacity - c.resident_blocks, np.inf)
            evicted = np.maximum((n - np.minimum(gpu, n)) - free, 0.0)
            extra = extra + self.evict_weight * evicted * cost.prefill_compute_s(bs, 0)
        return extra + ttft

    def scored(self, request: Request, view: View) -> tuple[int, npt.NDArray[np.float64]]:
        """(position, scores): `estimates` from the cost model's native kernel in one
        pass over the rows, and the `first_min` over (score, -prefix held or being
        computed, in flight, id). The same numbers as `estimates`, the readable
        reference (`tests/routing/test_kernels.py`)."""
        return self._score_rows(request, view, view.columns.pending_blocks)

    def _score_rows(
        self, request: Request, view: View, pending: npt.NDArray[np.int64]
    ) -> tuple[int, npt.NDArray[np.float64]]:
        """`scored`, with `pending` as the blocks being computed on each row."""
        worker, load, gpu, cpu, disk, _ = kernel_rows(view)
        return view.cost.kernel.quill(
            worker,
            load,
            gpu,
            cpu,
            disk,
            pending,
            len(request.content_keys),
            request.prompt_tokens,
            view.block_size,
            *self._kernel_state(request, view),
        )

    def chosen(self, request: Request, view: View) -> int:
        """`scored`'s position. On a prunable view, the native kernel scores the rows
        above the match's floor, then the others from the least queued on, and stops
        once a lower bound of the rest (no decodes, nothing waiting, no session batch:
        every other term only adds) exceeds the best score: the same row, without
        visiting every row (`CostKernel.quill_lowest`, `tests/routing/test_pruning.py`)."""
        walk = view.load_order(_BY_QUEUE) if len(view) >= WALK_MIN_ROWS else None
        if walk is not None:
            order, position = walk
            args = (
                *kernel_rows(view),
                len(request.content_keys),
                request.prompt_tokens,
                view.block_size,
                *self._kernel_state(request, view),
            )
            at = view.cost.kernel.quill_lowest(order, position, view.above_floor(), *args)
            if at is not None:
                return at
        at, scores = self.scored(request, view)
        self._last_scores = (request, view, scores)
        return at

    def _kernel_state(
        self, request: Request, view: View
    ) -> tuple[
        QuillSettings,
        float,
        bool,
        float,
        int,
        npt.NDArray[np.float64] | None,
        npt.NDArray[np.float64] | None,
        npt.NDArray[np.float64] | None,
        npt.NDArray[np.float64] | None,
    ]:
        """The kernel's arguments after the columns: the knobs, then this request's
        state, then the rows' own sequence slots and the fleet columns (capacity,
        resident blocks: the eviction term) (`CostKernel.quill`'s order)."""
        batch = None
        if self.home_decode_weight and self._session_kv_tokens:
            rows_of = _rows_by_worker(view.columns.worker)
            batch = np.zeros(len(view.columns.worker))
            for w, tokens in self._session_kv_tokens.items():
                batch[rows_of(w)] = tokens
        return (
            self._settings,
            self._lambda,
            self._continuing,
            self._mean_decodes,
            request.expected_output_tokens,
            batch,
            np.ascontiguousarray(view.columns.pace) if view.columns.paced else None,
            np.ascontiguousarray(view.columns.max_num_seqs) if view.columns.slotted else None,
            np.ascontiguousarray(view.columns.fleet) if self.evict_weight else None,
        )

    def route(self, request: Request, view: View) -> Decision:
        if not len(view):
            return self.no_workers()
        if view.order_only:
            return self.decide(request, view, self._cache_choice(request, view))
        c = view.columns
        count = len(c.worker)
        self._lambda = self.work_weight
        # summed in row order, as a loop over the workers adds them
        decodes, waiting = view.cost.kernel.load_sums(np.ascontiguousarray(c.load))
        self._mean_decodes = decodes / count
        if self.adaptive and self.work_scope == "cluster":
            # Each second of compute added delays every request that queues behind it:
            # weigh it by how many are waiting per worker right now.
            self._lambda = min(
                self._lambda * (self.work_base + waiting / count),
                self.max_work_weight,
            )
        sid = self._session_key(request) if self.sessions else None
        self._continuing = False
        self._session_kv_tokens = {}
        if sid is not None:
            self._session_load(sid, view)
        at = self.chosen(request, view)
        if self.sessions:
            worker = int(c.worker[at])
            if sid is not None:
                self._homes[sid] = (worker, view.now_s)
                self._live[worker] = self._live.get(worker, 0) + 1
            self._remember(request, sid, worker)
        # the blocks being computed there count as held (speculative residency)
        return self.decide_at(request, view, at, with_pending=self.speculative)

    def shortlist(
        self, request: Request, view: View, position: int, size: int
    ) -> list[Preference] | None:
        """The rows by this router's score (the state `route` left for this request),
        each preferred while its score with the queue that requests like this one add
        stays within the best other row's, and for more where the request's prefix is
        being computed (with speculation). Order-only views have no time to trade: the
        default shortlist."""
        if view.order_only or not len(view):
            return None
        last = self._last_scores
        if last is not None and last[0] is request and last[1] is view:
            scores = last[2]
        else:  # not scored whole by `route` (a walk), or called out of turn
            scores = self.scored(request, view)[1]
        held = None
        if self.speculative:
            # every row as if the request's whole prefix were being computed there: a
            # row's score depends on its own columns and the fleet-wide terms `route`
            # set, not on the other rows' residency
            pending = view.columns.pending_blocks
            held = self._score_rows(request, view, np.maximum(pending, len(request.content_keys)))[
                1
            ]
        return cost_preferences(request, view, scores, position, size, scores_if_held=held)

    def _cache_choice(self, request: Request, view: View) -> WorkerView:
        """Order-only: most reused tokens, least recent cache pressure."""
        bs = view.block_size
        n = len(request.content_keys)
        c = view.columns
        local = c.local_blocks
        reused = np.minimum(local, n) * bs - self.pressure_weight * c.queued_prefill_tokens
        return view.worker_at(first_min(-reused, c.in_flight, c.worker))

    def _session_key(self, request: Request) -> str | None:
        """The session a request is placed in: its own session id; else, with a parent
        hint (`Request.parent_id`), its parent's session, or, when the parent had none,
        the one the parent's first child opens (an agent DAG, a conversation sent
        without ids): that child is placed as a session's first turn (a home chosen for
        the decode batch its sessions make), the parent's later children and their
        descendants as its next turns. None: no session, or a parent this router did
        not place (or has forgotten).

        Not the parent's engine as the home: a parent without a session was routed
        as a lone request, not for the batch a session makes, and making its engine
        the home piled the agent-fanout generator's fan-outs there (mean TTFT +25 %,
        docs/results/simulator.md)."""
        if request.session_id is not None:
            return str(request.session_id)
        if request.parent_id is None:
            return None
        parent = self._placed.get(request.parent_id)
        if parent is None:
            return None
        return parent[0]

    def _remember(self, request: Request, sid: str | None, worker: int) -> None:
        """Where a request went, and the session its children join (its own, or one it
        opens), for the parent hints of the requests that follow it."""
        placed = self._placed
        placed[request.request_id] = (
            sid if sid is not None else f"\0after:{request.request_id}",
            worker,
        )
        if len(placed) > PARENTS_REMEMBERED:
            placed.popitem(last=False)

    def _session_load(self, sid: str, view: View) -> None:
        """Forget sessions idle for longer than the TTL, take this one out of its home
        (it is being placed now; a turn when its previous request was routed at least
        `concurrent_session_s` ago, else a request beside it) and, for a new session,
        estimate the KV each worker's live sessions' decodes read per step: live
        sessions x the fleet's decode KV (running decodes x their context, summed) per
        live session. The fleet's, not the worker's own running decodes: an engine
        whose sessions are between turns or queued for their prefill decodes nothing
        at this instant, and its own context would price its batch at nothing."""
        homes, live = self._homes, self._live
        horizon = view.now_s - self.session_ttl_s
        while homes:
            old, (worker, seen) = next(iter(homes.items()))
            if seen >= horizon:
                break
            del homes[old]
            live[worker] -= 1
        home = homes.pop(sid, None)
        if home is not None:
            live[home[0]] -= 1
            # a turn, unless the session's previous request was routed just now
            self._continuing = view.now_s - home[1] >= self.concurrent_session_s
            return
        # per live worker, its rows in the view (one per dp rank; the ids are sorted):
        # what a sum over the rows counts, without visiting every row
        rows_of = _rows_by_worker(view.columns.worker)
        rows = {w: len(rows_of(w)) for w, k in live.items() if k}
        total = sum(live[w] * n for w, n in rows.items())
        if total:
            c = view.columns
            # fsum: correctly rounded, so any summation order gives the same number
            kv = math.fsum((c.running_decodes * c.mean_context_tokens).tolist())
            per_session = kv / total
            # a worker absent here brings 0 * per_session = 0.0, what .get() defaults to
            self._session_kv_tokens = {w: live[w] * per_session for w, n in rows.items() if n}


#: Requests whose placement a router keeps for the parent hints of later ones.
PARENTS_REMEMBERED = 16_384
#: The load order `chosen` walks: queued prefill tokens.
_BY_QUEUE = ("queued_prefill_tokens",)
#: Views from this many rows on are walked rather than scored whole: below it, one pass
#: over every row costs less than the walk's set-up.
WALK_MIN_ROWS = 512


def _rows_by_worker(ids: npt.NDArray[np.uint64]) -> Callable[[int], npt.NDArray[np.intp]]:
    """A worker's rows in a view (one per dp rank; none: not in the view). Views are in
    id order, so a binary search finds them; a view built out of order gets a scan."""
    if len(ids) < 2 or bool((ids[1:] >= ids[:-1]).all()):

        def search(worker: int) -> npt.NDArray[np.intp]:
            key = np.uint64(worker)
            lo, hi = np.searchsorted(ids, key, "left"), np.searchsorted(ids, key, "right")
            return np.arange(lo, hi, dtype=np.intp)

        return search
    return lambda worker: np.flatnonzero(ids == np.uint64(worker))
