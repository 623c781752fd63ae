"""The engine model: one simulated vLLM worker's prefix cache and scheduler.

Cache (vLLM's V1 block pool, simplified):
- `capacity` GPU blocks. A block in use by a running request has a reference count;
  when the count drops to 0 a cached block joins the free queue (LRU, oldest first,
  a finished request's blocks in reverse order so its tail goes first) and stays
  reusable until its slot is needed. Only full prompt blocks are cached, as soon as
  they are computed (BlockStored at the end of the step that computed them).
- Generated tokens occupy blocks while the request runs but are not cached: a trace
  does not say what they were, so they could never be hit (an assumption).
- Two requests computing the same block at once share it (vLLM would keep two
  physical copies; a simplification that only affects capacity slightly).
- Pinned prefixes are never evicted. An optional CPU tier (LRU) receives every block
  evicted from the GPU (BlockStored medium CPU) and serves hits beyond the GPU prefix
  (loaded back, at the cost model's transfer time).

Scheduler (vLLM V1, simplified): FCFS; a step gives each decoding request one token,
then spends the remaining token budget (`max_num_batched_tokens`) on prefill chunks of
running, then waiting, requests. A request is admitted when its prompt and output
blocks fit (no preemption). The first token comes out of the step that finishes the
prefill. Runs of identical decode-only steps are taken in one macro step.

Every cache change is published as a vLLM wire-format event batch (`wire.py`) that
the simulator hands to `ControlPlane.ingest`, never to the index directly.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice

import numpy as np

from quillcache.costmodel import CostModel, prefill_pairs
from quillcache.sim import wire
from quillcache.sim.requests import SimRequest

_MASK = (1 << 64) - 1
_NO_TOKENS = b"\x90"  # an empty msgpack array
_GOLDEN = 0x9E3779B97F4A7C15
_GOLDEN_U64 = np.uint64(_GOLDEN)


def _drain(it: Iterator[object]) -> None:
    """Run an iterator of side effects at C speed."""
    deque(it, maxlen=0)


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    """Maximal runs [a, b) of consecutive values in ascending `indices`."""
    out: list[tuple[int, int]] = []
    start = prev = indices[0]
    for x in indices[1:]:
        if x != prev + 1:
            out.append((start, prev + 1))
            start = x
        prev = x
    out.append((start, prev + 1))
    return out


def engine_hash(key: int, salt: int) -> int:
    """The engine's opaque block hash for a content key (a bijection, so no collisions);
    deliberately not equal to the key: the index must not rely on the two agreeing."""
    return ((key ^ salt) * _GOLDEN) & _MASK


@dataclass(slots=True)
class Running:
    """A request admitted on this engine."""

    req: SimRequest
    keys: list[int]  # content keys of its full prompt blocks
    hit_blocks: int  # GPU prefix hit at admission (including CPU / peer loads)
    cpu_blocks: int  # of which loaded from the CPU tier
    peer_blocks: int  # of which pulled from a peer
    computed: int  # prompt tokens computed or reused so far
    stored_blocks: int  # full blocks cached so far
    output_done: int = 0
    first_token_s: float = -1.0
    extra_s: float = 0.0  # transfer time charged to its first prefill step
    reserved: int = 0  # slots reserved at admission


class EngineModel:
    """One worker: prefix cache + scheduler, producing KV event batches."""

    def __init__(
        self,
        worker: int,
        *,
        capacity_blocks: int,
        block_size: int,
        cost: CostModel,
        cpu_blocks: int = 0,
        max_num_batched_tokens: int | None = None,
        max_num_seqs: int | None = None,
        dp_rank: int = 0,
        salt: int = 0x5EED,
    ) -> None:
        self.worker = worker
        self.capacity = capacity_blocks
        self.block_size = block_size
        self.cost = cost
        self.dp_rank = dp_rank
        self.salt = (salt * 1_000_003 + worker) & _MASK
        self.budget = max_num_batched_tokens or cost.config.engine.max_num_batched_tokens
        self.max_seqs = max_num_seqs or cost.config.engine.max_num_seqs
        # cache state
        self.refs: dict[int, int] = {}  # key -> requests using it (> 0)
        self.free: OrderedDict[int, None] = OrderedDict()  # cached, unused, LRU first
        self.uncached_held = 0
        self.pinned: set[int] = set()
        self.cpu_capacity = cpu_blocks
        self.cpu: OrderedDict[int, None] = OrderedDict()
        self._events: list[bytes] = []
        self._extra_events = 0  # items of _events holding n > 1 events add n - 1
        # scheduler state
        self.waiting: deque[Running] = deque()
        self.running: list[Running] = []
        self.queued_prefill_tokens = 0
        self.queued_pairs = 0.0  # their attention pairs (`queued_prefill_pairs`)
        # counters
        self.evictions = 0

    # --- cache --------------------------------------------------------------------
    # Slot accounting: capacity = len(refs) (held cached blocks) + uncached_held (slots
    # reserved by running requests for blocks not computed yet, partial and output
    # blocks) + len(free) (cached, unused) + unused slots holding nothing.

    def prefix_hit(self, keys: list[int]) -> tuple[int, int]:
        """(GPU prefix blocks, further blocks in the CPU tier) for these keys."""
        refs, free = self.refs, self.free
        n = 0
        for k in keys:
            if k in refs or k in free:
                n += 1
            else:
                break
        c = 0
        if self.cpu:
            for k in keys[n:]:
                if k in self.cpu:
                    c += 1
                else:
                    break
        return n, c

    @property
    def in_use(self) -> int:
        return len(self.refs) + self.uncached_held

    @property
    def kv_usage(self) -> float:
        return self.in_use / self.capacity if self.capacity else 1.0

    def _acquire(self, key: int) -> None:
        r = self.refs.get(key)
        if r is None:
            del self.free[key]
            self.refs[key] = 1
        else:
            self.refs[key] = r + 1

    def _release(self, key: int) -> None:
        r = self.refs[key] - 1
        if r:
            self.refs[key] = r
        else:
            del self.refs[key]
            self.free[key] = None

    def _make_room(self, slots: int, held: int = 0) -> None:
        """Evict LRU free cached blocks until `slots` slots hold nothing (`held`: blocks
        in use that `refs` does not count)."""
        need = slots - (self.capacity - self.in_use - held - len(self.free))
        if need <= 0:
            return
        free, events, salt, removed = self.free, self._events, self.salt, wire.block_removed
        if not self.cpu_capacity and need > 1 and free:
            # The common case, encoded in one pass: same events as the loop below.
            keys = list(islice(free, need))  # the LRU end, oldest first
            _drain(map(free.__delitem__, keys))
            hashes = (np.array(keys, dtype=np.uint64) ^ np.uint64(salt)) * np.uint64(_GOLDEN)
            events.append(wire.blocks_removed(hashes))
            self._extra_events += len(keys) - 1
            self.evictions += len(keys)
            return
        while need > 0 and free:
            key, _ = free.popitem(last=False)
            if self.cpu_capacity:
                self._offload(key)
            events.append(removed(((key ^ salt) * _GOLDEN) & _MASK))  # engine_hash, inlined
            self.evictions += 1
            need -= 1

    def _offload(self, key: int) -> None:
        """Copy an evicted GPU block to the CPU tier. Published *before* the GPU removal
        and by hash only (as vLLM's offloading reports it): the index still knows the
        hash from the GPU copy."""
        if key in self.cpu:
            self.cpu.move_to_end(key)
            return
        if len(self.cpu) >= self.cpu_capacity:
            old, _ = self.cpu.popitem(last=False)
            self._events.append(wire.block_removed(engine_hash(old, self.salt), "CPU"))
        self.cpu[key] = None
        self._events.append(
            wire.block_stored(
                [engine_hash(key, self.salt)], None, _NO_TOKENS, self.block_size, "CPU"
            )
        )

    def _store(self, run: Running, upto: int) -> None:
        """Cache `run`'s full blocks [stored_blocks, upto) and publish the new ones."""
        start = run.stored_blocks
        if upto <= start:
            return
        keys = run.keys
        refs, free = self.refs, self.free
        new: list[int] = []  # indices of blocks this request really adds
        for i in range(start, upto):
            k = keys[i]
            if k in refs or k in free:
                # Computed concurrently by another request: share it (module docstring).
                self._acquire(k)
            else:
                refs[k] = 1
                new.append(i)
            self.uncached_held -= 1
        run.stored_blocks = upto
        self._publish(run, new)

    def _publish(self, run: Running, new: list[int]) -> None:
        """BlockStored for the blocks at indices `new` (ascending) of `run.keys`."""
        keys = run.keys
        key_array = run.req.keys  # the same keys as uint64: hashes in one numpy pass
        salt = np.uint64(self.salt)
        # Publish maximal runs of consecutive new blocks, each chained to its parent.
        if not new:
            return
        # the usual case, one run: skip the scan
        runs = [(new[0], new[-1] + 1)] if new[-1] - new[0] == len(new) - 1 else _runs(new)
        for a, b in runs:
            parent = engine_hash(keys[a - 1], self.salt) if a else None
            hashes = (key_array[a:b] ^ salt) * _GOLDEN_U64  # engine_hash, vectorised
            tokens = run.req.packed_block_tokens(a, b)
            self._events.append(wire.block_stored(hashes, parent, tokens, self.block_size))

    def pin(self, req: SimRequest) -> None:
        """Keep `req`'s full prompt blocks resident forever (they hold slots)."""
        run = Running(req, req.keys_list, 0, 0, 0, 0, 0)
        gpu, _ = self.prefix_hit(run.keys)
        for k in run.keys[:gpu]:
            self._acquire(k)
        n = len(run.keys) - gpu
        self._make_room(n)
        self.uncached_held += n
        run.stored_blocks = gpu
        self._store(run, len(run.keys))
        self.pinned.update(run.keys)

    # --- admission ------------------------------------------------------------------

    def blocks_needed(self, req: SimRequest) -> int:
        return -(-(req.prompt_tokens + req.output_tokens) // self.block_size)

    def fits_ever(self, req: SimRequest) -> bool:
        return self.blocks_needed(req) <= self.capacity - len(self.pinned)

    def _admit(self, run: Running, total: int) -> bool:
        """Reserve `total` slots for `run`, taking its cached prefix; False if it must wait."""
        req = run.req
        keys = run.keys
        bs = self.block_size
        gpu, cpu = self.prefix_hit(keys)
        last_full = max((req.prompt_tokens - 1) // bs, 0)  # vLLM computes >= 1 token
        gpu = min(gpu, last_full, total)
        cpu = min(cpu, last_full - gpu, total - gpu)
        reuse_free = sum(1 for k in keys[:gpu] if k in self.free)
        unused = self.capacity - self.in_use  # includes free cached slots
        if total - gpu > unused - reuse_free:
            return False
        for k in keys[:gpu]:
            self._acquire(k)
        for k in keys[gpu : gpu + cpu]:  # most recently used in the CPU tier
            self.cpu.move_to_end(k)
        self._make_room(total - gpu)
        self.uncached_held += total - gpu
        run.hit_blocks = gpu
        run.stored_blocks = gpu
        run.computed = gpu * bs
        # Offloads made by _make_room may have pushed some of them out of a small tier.
        still = 0
        for k in keys[gpu : gpu + cpu]:
            if k not in self.cpu:
                break
            still += 1
        cpu = still
        if cpu:
            run.cpu_blocks = cpu
            run.extra_s += self.cost.transfer_time(cpu, "cpu")
            self._store(run, gpu + cpu)
            run.hit_blocks = gpu + cpu
            run.computed = run.hit_blocks * bs
        peer_end = min(run.peer_blocks, last_full, len(keys), total)
        if peer_end > run.hit_blocks:
            run.extra_s += self.cost.transfer_time(peer_end - run.hit_blocks, "peer")
            self._store(run, peer_end)
            run.peer_blocks = peer_end - run.hit_blocks
            run.hit_blocks = peer_end
            run.computed = peer_end * bs
        else:
            run.peer_blocks = 0
        run.reserved = total
        return True

    def _finish(self, run: Running) -> None:
        # Reverse order: the tail of the prompt becomes the oldest free block.
        for k in reversed(run.keys[: run.stored_blocks]):
            self._release(k)
        self.uncached_held -= run.reserved - run.stored_blocks

    # --- order-only replay ------------------------------------------------------------

    def serve_instantly(self, req: SimRequest, peer_blocks: int = 0) -> tuple[Running, bytes]:
        """`--timing none`: admit, compute and finish at once; returns the run and the
        event batch it published (empty bytes if nothing changed). A request larger
        than the whole cache caches only the prompt blocks that fit."""
        run = Running(req, req.keys_list, 0, 0, peer_blocks, 0, 0)
        total = self.blocks_needed(req)
        room = self.capacity - len(self.pinned)
        if total > room:
            run.keys = run.keys[: max(room, 0)]
            total = len(run.keys)
        if not (self.refs or self.uncached_held or self.cpu_capacity or peer_blocks):
            self._serve_idle(run, total)
            return run, self.drain_events(req.arrival_s)
        if not self._admit(run, total):  # cannot happen with nothing running
            raise AssertionError("an idle engine could not admit a request that fits")
        self._store(run, len(run.keys))
        run.computed = req.prompt_tokens
        self._finish(run)
        return run, self.drain_events(req.arrival_s)

    def _serve_idle(self, run: Running, total: int) -> None:
        """`_admit` + `_store` + `_finish` on an engine holding nothing (no running
        request, pinned block or tier), without reference counts: the same cache
        changes and events, in the same order (checked against the general path in
        tests/sim/test_engine.py)."""
        keys, free, bs = run.keys, self.free, self.block_size
        gpu = 0
        for k in keys:
            if k not in free:
                break
            gpu += 1
        gpu = min(gpu, max((run.req.prompt_tokens - 1) // bs, 0), total)
        _drain(map(free.__delitem__, keys[:gpu]))  # held: not evictable meanwhile
        # _make_room(total - gpu) with the `gpu` held blocks counted as in use
        self._make_room(total - gpu, held=gpu)
        new: list[int] = []
        for i in range(gpu, len(keys)):
            if keys[i] in free:  # cached behind a miss: reused, not published
                del free[keys[i]]
            else:
                new.append(i)
        self._publish(run, new)
        # finish: none of `keys` is in `free` now; the tail becomes the oldest free block
        free.update(dict.fromkeys(reversed(keys)))
        run.hit_blocks = gpu
        run.stored_blocks = len(keys)
        run.reserved = total
        run.computed = run.req.prompt_tokens

    def drain_events(self, ts: float) -> bytes:
        if not self._events:
            return b""
        payload = wire.batch(ts, self._events, self.dp_rank, len(self._events) + self._extra_events)
        self._events = []
        self._extra_events = 0
        return payload

    # --- timed scheduler -----------------------------------------------------------------

    def enqueue(self, req: SimRequest, peer_blocks: int = 0) -> Running:
        run = Running(req, req.keys_list, 0, 0, peer_blocks, 0, 0)
        gpu, cpu = self.prefix_hit(run.keys)
        run.hit_blocks = gpu + cpu  # provisional, fixed at admission
        self.waiting.append(run)
        self.queued_prefill_tokens += max(req.prompt_tokens - run.hit_blocks * self.block_size, 1)
        self.queued_pairs += self._waiting_pairs(run)
        return run

    def _waiting_pairs(self, run: Running) -> float:
        """A waiting request's part of the queue's attention pairs: its uncached tokens
        after its provisional hit."""
        new = max(run.req.prompt_tokens - run.hit_blocks * self.block_size, 1)
        return prefill_pairs(new, run.req.prompt_tokens - new)

    @staticmethod
    def _running_pairs(run: Running) -> float:
        """An admitted request's part: its tokens not computed yet, after those it has."""
        left = run.req.prompt_tokens - run.computed
        return prefill_pairs(left, run.computed) if left > 0 else 0.0

    def abort(self, run: Running) -> None:
        """Drop a queued or running request (client went away) and free its blocks;
        blocks it already cached stay cached, like vLLM's abort."""
        if run in self.waiting:
            self.waiting.remove(run)
            self.queued_prefill_tokens -= max(
                run.req.prompt_tokens - run.hit_blocks * self.block_size, 1
            )
            self.queued_pairs -= self._waiting_pairs(run)
        elif run in self.running:
            self.running.remove(run)
            self.queued_prefill_tokens -= max(run.req.prompt_tokens - run.computed, 0)
            self.queued_pairs -= self._running_pairs(run)
            self._finish(run)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def plan_step(self) -> tuple[float, int, list[tuple[Running, int]], list[Running]]:
        """Decide the next step: (duration, decode steps, prefill chunks, decoders).

        Admits waiting requests that fit. A decode-only step with nothing to admit is
        returned with the number of identical steps until the first request finishes.
        """
        budget = self.budget
        decoders = [r for r in self.running if r.computed >= r.req.prompt_tokens]
        budget -= len(decoders)
        chunks: list[tuple[Running, int]] = []
        flops_s = 0.0
        extra_s = 0.0
        for r in self.running:
            if budget <= 0:
                break
            left = r.req.prompt_tokens - r.computed
            if left > 0:
                n = min(left, budget)
                chunks.append((r, n))
                flops_s += self.cost.prefill_compute_s(n, r.computed)
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_seqs:
            run = self.waiting[0]
            provisional = max(run.req.prompt_tokens - run.hit_blocks * self.block_size, 1)
            provisional_pairs = self._waiting_pairs(run)
            if not self._admit(run, self.blocks_needed(run.req)):
                break
            self.waiting.popleft()
            self.queued_prefill_tokens -= provisional
            self.queued_prefill_tokens += max(run.req.prompt_tokens - run.computed, 0)
            self.queued_pairs += self._running_pairs(run) - provisional_pairs
            self.running.append(run)
            extra_s += run.extra_s
            left = run.req.prompt_tokens - run.computed
            n = min(left, budget)
            chunks.append((run, n))
            flops_s += self.cost.prefill_compute_s(n, run.computed)
            budget -= n
        ctx = sum(r.req.prompt_tokens + r.output_done for r in decoders)
        step = self.cost.step_time(flops_s, len(decoders), ctx) + extra_s
        if chunks or not decoders:
            return step, 1, chunks, decoders
        # decode only: identical steps until the first request completes
        k = min(r.req.output_tokens - r.output_done for r in decoders)
        return step, max(k, 1), chunks, decoders

    def apply_step(
        self,
        end_s: float,
        steps: int,
        chunks: list[tuple[Running, int]],
        decoders: list[Running],
        step_s: float,
    ) -> list[Running]:
        """Apply `steps` steps ending at `end_s`; returns the requests that finished."""
        done: list[Running] = []
        for r, n in chunks:
            self.queued_pairs -= prefill_pairs(n, r.computed)  # this chunk's
            r.computed += n
            self.queued_prefill_tokens -= n
            full = min(r.computed // self.block_size, len(r.keys))
            self._store(r, full)
            if r.computed >= r.req.prompt_tokens:
                r.first_token_s = end_s
                r.output_done = 1
                if r.req.output_tokens <= 1:
                    done.append(r)
        for r in decoders:
            r.output_done += steps
            if r.output_done >= r.req.output_tokens:
                # the last token came at the end of its own step, not of the macro step
                done.append(r)
        for r in done:
            self.running.remove(r)
            self._finish(r)
        return done

    def queued_prefill_pairs(self) -> float:
        """The attention pairs of the prefill still to run (`costmodel.prefill_pairs`
        of each request), kept as requests queue, are admitted and compute chunks (a
        chunk of a request takes away exactly its part: the pairs are integers)."""
        return max(self.queued_pairs, 0.0)

    def queue_time(self) -> float:
        """The cost model's wait for the queued prefill here."""
        return self.cost.queue_time(max(self.queued_prefill_tokens, 0), self.queued_prefill_pairs())

    def load(self) -> dict[str, float]:
        decoding = [r for r in self.running if r.computed >= r.req.prompt_tokens]
        mean_ctx = (
            sum(r.req.prompt_tokens + r.output_done for r in decoding) / len(decoding)
            if decoding
            else 0.0
        )
        return {
            "in_flight": len(self.running) + len(self.waiting),
            "queued_prefill_tokens": max(self.queued_prefill_tokens, 0),
            "running_decodes": len(decoding),
            "kv_usage": self.kv_usage,
            "mean_context_tokens": mean_ctx,
            "queued_prefill_pairs": self.queued_prefill_pairs(),
        }
