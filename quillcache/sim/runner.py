"""Run one workload through one router and one index backend.

Both modes drive the real `ControlPlane`: requests are routed through a `View` built
from `index.match`, and engines' cache changes reach the index only as vLLM
wire-format event batches through `ControlPlane.ingest`.

- `timing="none"` (order-only replay): each request is routed, then served at once;
  its blocks are cached (and their events applied) before the next one arrives. An
  exact cache analysis, no cost model. Load-aware routers see a load proxy: the
  requests (and prefill tokens) each worker received among the last
  `load_window` requests.
- `timing="full"`: a discrete-event simulation of every engine's continuous batching
  with the cost model's step times; requests wait, prefill in chunks, decode.

In both, a request with parents (closed loop, `quillcache.sim.release`) arrives when
its last parent has finished plus its think / tool time; the others at their time.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from quillcache.controlplane import ControlPlane, OpLatencies
from quillcache.controlplane.admission import missed
from quillcache.costmodel import CostModel, prefill_pairs
from quillcache.errors import ConfigError
from quillcache.index import ApplyStats, IndexBackend, KeyArray
from quillcache.routing import SLO, Action, Decision, Request, Router, create_router
from quillcache.sim.dp import EnginePlacement, Placement, RankLoad
from quillcache.sim.dp import check as check_dp
from quillcache.sim.engine import EngineModel, Running
from quillcache.sim.metrics import Record, RunResult
from quillcache.sim.release import Arrivals
from quillcache.sim.requests import SimRequest
from quillcache.sim.workload import Workload

if TYPE_CHECKING:
    from quillcache.sim.replicas import ReplicaConfig
    from quillcache.sim.replicate import ReplicateSettings, Replicator
    from quillcache.sim.retain import Retainer, RetainSettings
    from quillcache.sim.slo_wait import SloWaiters

Timing = Literal["full", "none"]
Progress = Callable[[int], None]


class Plane(Protocol):
    """What the replay loops call: one `ControlPlane`, or a `ReplicaFleet` of them."""

    @property
    def index(self) -> IndexBackend: ...

    @property
    def apply_stats(self) -> ApplyStats: ...

    def route(self, request: Request, now_s: float = 0.0) -> Decision: ...

    def ingest(self, worker: int, payloads: Sequence[bytes]) -> Any: ...

    def update_load(self, worker: int, **load: float) -> None: ...

    def prefill_done(self, request_id: int | str, now_s: float | None = None) -> None: ...

    def finish(self, request_id: int | str) -> None: ...

    def computing(self, keys: KeyArray) -> set[int]: ...

    def close(self) -> None: ...


@dataclass
class SimConfig:
    """Cluster shape for one run."""

    workers: int = 4
    capacity_blocks: int | None = None  # per worker; None: from the cost model
    cpu_blocks: int = 0  # per worker CPU tier; 0 disables it
    timing: Timing = "full"
    seed: int = 0
    speculative: bool = True
    load_window: int | None = None  # timing none: None -> 4 x workers
    # worker -> factor: its GPU computes and reads memory that many times slower (the
    # routers' cost model does not know; they see it only in the worker's load)
    slow_workers: dict[int, float] = field(default_factory=dict)
    # worker -> time (s): it registers with the gateway at the first arrival at or after
    # that time, with an empty cache (an engine joining mid-run); before, nothing routes to it
    join_at_s: dict[int, float] = field(default_factory=dict)
    # worker -> its sequence slots (`max_num_seqs`, per rank), which its engine runs with
    # and the gateway is told (a fleet of mixed GPUs); the others: the cost model's
    max_num_seqs: dict[int, int] = field(default_factory=dict)
    # data-parallel ranks per worker, each its own engine (`quillcache.sim.dp`), and who
    # places a request on a rank: the gateway's decision or the engine's own balancer
    dp_ranks: int = 1
    dp_placement: Placement = "gateway"
    # hot-prefix replication (`quillcache.sim.replicate`); None: off
    replicate: ReplicateSettings | None = None
    # every request's SLO (as `x-slo-ttft-ms` / `x-slo-tbt-ms` give it online); None: none.
    # With `admission`, the control plane's admission stage rejects a request whose
    # estimate on the chosen engine misses it (`controlplane.admission`, every router);
    # without, the requests are routed as if they had none and only the report reads it
    slo: SLO | None = None
    admission: bool = True
    # the gateway's `slo_admission: queue`: a request the stage refuses while waiting
    # could help waits, retried every `slo_queue_tick_s` against what is left of its
    # TTFT SLO, at most `slo_queue_max` at once (`quillcache.sim.slo_wait`)
    slo_queue: bool = False
    slo_queue_max: int = 1024
    slo_queue_tick_s: float = 0.01
    # session retention (`quillcache.sim.retain`): every session's hint; None: off
    retain: RetainSettings | None = None

    def check(self) -> None:
        if self.workers <= 0:
            raise ConfigError(f"workers must be positive, got {self.workers}")
        if self.replicate is not None:
            if self.timing != "full":
                raise ConfigError("replication is simulated with full timing only (no queues)")
            if self.dp_ranks != 1:
                raise ConfigError("replication is simulated with one rank per worker only")
            self.replicate.check()
        if self.retain is not None:
            if self.timing != "full":
                raise ConfigError("retention is simulated with full timing only (no queues)")
            if self.dp_ranks != 1:
                raise ConfigError("retention is simulated with one rank per worker only")
            self.retain.check()
        check_dp(self.dp_ranks, self.dp_placement)
        for what, table in (("slow worker", self.slow_workers), ("joining worker", self.join_at_s)):
            for w in table:
                if not 0 <= w < self.workers:
                    raise ConfigError(f"{what} {w} is not one of the {self.workers} workers")
        for w, factor in self.slow_workers.items():
            if not factor > 0:
                raise ConfigError(f"slow worker {w}: the factor must be positive, got {factor}")
        for w, seqs in self.max_num_seqs.items():
            if not 0 <= w < self.workers:
                raise ConfigError(f"max_num_seqs: worker {w} is not one of the {self.workers}")
            if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
                raise ConfigError(f"max_num_seqs of worker {w} must be a whole number >= 1")
        for w, t in self.join_at_s.items():
            if not t >= 0:
                raise ConfigError(f"joining worker {w}: the time must be >= 0 s, got {t}")
        if len(self.join_at_s) >= self.workers:
            raise ConfigError("at least one worker must be there from the start")
        if self.slo is not None:
            for name, bound in (("TTFT", self.slo.ttft_s), ("TBT", self.slo.tbt_s)):
                if bound is not None and not (0 < bound < math.inf):
                    raise ConfigError(f"the {name} SLO must be a positive number of seconds")
            if self.slo.ttft_s is None and self.slo.tbt_s is None:
                raise ConfigError("an SLO needs a TTFT or a TBT bound")
            if self.timing != "full":
                raise ConfigError("SLOs are simulated with full timing only (no queues)")
        if self.slo_queue:
            if self.slo is None or self.slo.ttft_s is None or not self.admission:
                raise ConfigError("the SLO queue needs a TTFT SLO and admission")
            if isinstance(self.slo_queue_max, bool) or self.slo_queue_max < 1:
                raise ConfigError(f"slo_queue_max must be >= 1, got {self.slo_queue_max}")
            if not 0 < self.slo_queue_tick_s <= 1.0:
                raise ConfigError(
                    f"slo_queue_tick_s must be in (0, 1] s, got {self.slo_queue_tick_s}"
                )

    def capacity_for(self, cost: CostModel, block_size: int) -> int:
        if self.capacity_blocks is not None:
            if self.capacity_blocks <= 0:
                raise ConfigError(f"capacity must be positive, got {self.capacity_blocks}")
            return self.capacity_blocks
        return cost.kv_capacity_blocks(block_size)


def _peer_end(decision: Decision) -> int:
    for step in decision.plan:
        if step.action == Action.FETCH_PEER:
            return step.end
    return 0


def _explained(rec: Record, decision: Decision) -> None:
    why = decision.explanation
    if why is not None:
        rec.avoided_tokens = why.avoided_tokens
        rec.avoidable_tokens = why.avoidable_tokens


def run(
    workload: Workload,
    router: str | Router,
    backend: str,
    config: SimConfig,
    cost: CostModel,
    *,
    router_options: dict[str, Any] | None = None,
    progress: Progress | None = None,
    replicas: ReplicaConfig | None = None,
) -> RunResult:
    """One run; with `replicas`, through N gateway replicas (`quillcache.sim.replicas`),
    and the result says how many, their state and their routing precision."""
    config.check()
    bs = workload.block_size
    capacity = config.capacity_for(cost, bs)
    latencies = OpLatencies()
    speculative = config.speculative and config.timing == "full"
    engines = [
        EngineModel(
            w,
            capacity_blocks=capacity,
            block_size=bs,
            cost=_slowed(cost, config.slow_workers.get(w, 1.0)),
            cpu_blocks=config.cpu_blocks,
            dp_rank=k,
            max_num_seqs=config.max_num_seqs.get(w),
        )
        for w in range(config.workers)
        for k in range(config.dp_ranks)
    ]
    cp: Plane
    add_worker: Callable[..., Any]
    fleet = None
    if replicas is None:
        router_obj = (
            create_router(router, seed=config.seed, **(router_options or {}))
            if isinstance(router, str)
            else router
        )
        router_name = router_obj.name or type(router_obj).__name__
        cp = plane = ControlPlane(
            index=backend,
            router=router_obj,
            cost=cost,
            block_size=bs,
            speculative=speculative,
            order_only=config.timing == "none",
            latencies=latencies,
            explain=True,
        )
        add_worker = plane.add_worker
    else:
        from quillcache.sim.replicas import ReplicaFleet

        cp = fleet = ReplicaFleet(
            replicas,
            router=router,
            router_options=router_options,
            backend=backend,
            cost=cost,
            block_size=bs,
            speculative=speculative,
            order_only=config.timing == "none",
            seed=config.seed,
            latencies=latencies,
        )
        fleet.attach(engines)
        fleet.know(workload.requests)
        router_name = fleet.router_name
        add_worker = fleet.add_worker
    if config.join_at_s and fleet is not None:
        raise ConfigError("an engine joining mid-run is simulated behind one gateway only")
    if config.dp_ranks > 1 and fleet is not None:
        raise ConfigError("data-parallel ranks are simulated behind one gateway only")
    ranks = _Ranks(cp, config)
    joined: set[int] = set()  # the workers registered so far (replication targets)
    replicator = None
    if config.replicate is not None:
        from quillcache.sim.replicate import Replicator

        replicator = Replicator(config.replicate, engines, cp.computing)
    retainer = None
    if config.retain is not None:
        if fleet is not None:
            raise ConfigError("retention is simulated behind one gateway only (no replicas)")
        from quillcache.sim.retain import Retainer

        assert isinstance(cp, ControlPlane)
        retainer = Retainer(config.retain, engines, cp)

    def join(w: int, now: float) -> None:
        joined.add(w)
        seqs = config.max_num_seqs.get(w)
        if config.dp_ranks == 1:
            add_worker(w, capacity_blocks=capacity, model=workload.model, max_num_seqs=seqs)
        else:
            assert isinstance(cp, ControlPlane)  # ranks: one gateway (checked above)
            cp.add_worker(
                w,
                capacity_blocks=capacity,
                model=workload.model,
                dp_ranks=config.dp_ranks,
                max_num_seqs=seqs,
            )
        for slot in ranks.slots(w):
            eng = engines[slot]
            for pre in workload.pinned:
                eng.pin(pre)
            payload = eng.drain_events(now)
            if payload:
                ranks.ingest(slot, payload)

    for w in range(config.workers):
        if w not in config.join_at_s:
            join(w, 0.0)
    joins = _Joins(sorted((t, w) for w, t in config.join_at_s.items()), join)
    t0 = time.perf_counter()
    waiters = None
    try:
        if config.timing == "none":
            records = _order_only(workload, cp, ranks, engines, config, progress, joins)
        elif config.timing == "full":
            slo = config.slo if config.admission else None
            policies = _Policies(replicator, retainer, joined)
            if config.slo_queue and slo is not None:
                from quillcache.sim.slo_wait import SloWaiters

                waiters = SloWaiters(slo, config.slo_queue_max, config.slo_queue_tick_s)
            records = _timed(workload, cp, ranks, engines, progress, joins, policies, slo, waiters)
        else:
            raise ConfigError(f"timing must be 'full' or 'none', got {config.timing!r}")
        wall = time.perf_counter() - t0
        stats = cp.index.stats()
    finally:
        cp.close()
    sweep: dict[str, Any] = {}
    if fleet is not None and replicas is not None:
        sweep = {
            "replicas": replicas.replicas,
            "replica_state": replicas.state,
            "lb": replicas.lb,
            "routing_precision": round(fleet.precision, 6),
        }
    return RunResult(
        router=router_name,
        backend=backend,
        timing=config.timing,
        workers=config.workers,
        capacity_blocks=capacity,
        block_size=bs,
        records=records,
        index_blocks=stats.blocks,
        events_applied=cp.apply_stats.events,
        match_ns=latencies.match_ns,
        apply_ns=latencies.apply_ns,
        wall_s=wall,
        sweep=sweep,
        kv_gib_per_engine=cost.kv_gib(capacity, bs),
        kv_exceeds_gpu=cost.kv_memory_warning(capacity, bs) is not None,
        policy={
            **(replicator.stats() if replicator is not None else {}),
            **(retainer.stats() if retainer is not None else {}),
            **(waiters.stats() if waiters is not None else {}),
        },
        slo=config.slo,
        admission=config.admission,
    )


def _slowed(cost: CostModel, factor: float) -> CostModel:
    """The cost model of a GPU `factor` times slower in compute and memory bandwidth,
    with that many times the per-step overhead."""
    if factor == 1.0:
        return cost
    g = cost.config.gpu
    return CostModel(
        cost.config.with_overrides(
            {
                "gpu.peak_tflops": g.peak_tflops / factor,
                "gpu.hbm_gbps": g.hbm_gbps / factor,
                "gpu.step_overhead_s": g.step_overhead_s * factor,
            }
        )
    )


class _Ranks:
    """Engines are slots `worker * K + rank`; this maps a decision to its slot and
    reports a slot's events and load under its (worker, rank). With one rank per
    worker the calls are exactly the single-engine ones."""

    def __init__(self, cp: Plane, config: SimConfig) -> None:
        self.k = config.dp_ranks
        self._cp = cp
        self._plane = cp if isinstance(cp, ControlPlane) else None
        self._engine = (
            EnginePlacement(config.workers, self.k) if config.dp_placement == "engine" else None
        )

    def slots(self, worker: int) -> range:
        return range(worker * self.k, (worker + 1) * self.k)

    def slot(self, decision: Decision, loads: Callable[[int], RankLoad]) -> int:
        """The engine serving a routed decision; `loads(slot)` is what vLLM's balancer
        sees of a rank."""
        w = decision.worker
        assert w is not None
        if self.k == 1:
            return w
        if self._engine is not None:
            return w * self.k + self._engine.choose(w, [loads(s) for s in self.slots(w)])
        return w * self.k + (decision.dp_rank or 0)

    def ingest(self, slot: int, payload: bytes) -> None:
        if self.k == 1:
            self._cp.ingest(slot, [payload])
            return
        assert self._plane is not None
        w, rank = divmod(slot, self.k)
        self._plane.ingest(w, [payload], rank)

    def report(self, slot: int, **load: float) -> None:
        if self.k == 1:
            self._cp.update_load(slot, **load)
            return
        assert self._plane is not None
        w, rank = divmod(slot, self.k)
        self._plane.update_rank_load(w, rank, **load)


class _Joins:
    """Workers waiting to join, in time order; `due(now)` registers those whose time
    has come (called before each arrival is routed)."""

    def __init__(self, pending: list[tuple[float, int]], join: Callable[[int, float], None]):
        self._pending = deque(pending)
        self._join = join

    def due(self, now: float) -> None:
        while self._pending and self._pending[0][0] <= now:
            _, w = self._pending.popleft()
            self._join(w, now)


def waits(request: Request, decision: Decision) -> bool:
    """Whether a refusal of the admission stage is one waiting could help (a TTFT miss
    by the chosen engine's queue: `SloMiss.waiting_helps`)."""
    miss = missed(request, decision, None)
    return miss is not None and miss.waiting_helps


def _request(r: Any, parent_hints: bool, slo: SLO | None = None) -> Request:
    """The router's request; with `parent_hints`, the first request it waits for is its
    parent (closed loop: the previous turn, the planner, the first call of a join)."""
    return Request(
        slo=slo,
        request_id=r.rid,
        content_keys=r.keys,
        prompt_tokens=r.prompt_tokens,
        session_id=r.session_id,
        expected_output_tokens=r.output_tokens,
        arrival_s=r.arrival_s,
        parent_id=r.parents[0] if parent_hints and r.parents else None,
    )


class _ParentShare:
    """The leading full blocks a request shares with its first parent (closed loop: the
    previous turn, the planner): what it can find cached if the parent's prompt stayed
    on its engine. -1 for a request without a parent."""

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self._keys = {r.rid: r.keys for r in requests}

    def __call__(self, r: SimRequest) -> int:
        if not r.parents:
            return -1
        parent = self._keys.get(r.parents[0])
        if parent is None:
            return -1
        n = min(len(r.keys), len(parent))
        differ = np.flatnonzero(r.keys[:n] != parent[:n])
        return int(differ[0]) if len(differ) else n


def _order_only(
    workload: Workload,
    cp: Plane,
    ranks: _Ranks,
    engines: list[EngineModel],
    config: SimConfig,
    progress: Progress | None,
    joins: _Joins,
) -> list[Record]:
    window = config.load_window or 4 * config.workers
    recent: deque[tuple[int, int, float]] = deque()
    in_flight = [0] * len(engines)
    queued = [0] * len(engines)
    pairs = [0.0] * len(engines)
    records: list[Record] = []
    bs = workload.block_size
    arrivals = Arrivals(workload.requests)
    shared = _ParentShare(workload.requests)
    n = -1
    while arrivals:
        r = arrivals.pop()
        n += 1
        rec = Record(r.rid, -1, r.arrival_s, r.prompt_tokens, r.prompt_blocks, r.output_tokens)
        rec.parent_blocks = shared(r)
        records.append(rec)
        # order-only: a request is served, hence finished, the moment it arrives
        arrivals.finished(r.rid, r.arrival_s, r.arrival_s)
        joins.due(r.arrival_s)
        decision = cp.route(_request(r, workload.parent_hints), r.arrival_s)
        w = decision.worker
        if w is None:
            rec.rejected = decision.reason or "rejected"
            continue
        # the load proxy stands for the requests running on a rank
        s = ranks.slot(decision, lambda x: RankLoad(0, in_flight[x], engines[x].kv_usage))
        run, payload = engines[s].serve_instantly(r, _peer_end(decision))
        if payload:
            ranks.ingest(s, payload)
        rec.worker = w
        _explained(rec, decision)
        rec.hit_blocks = run.hit_blocks
        rec.first_token_s = rec.finish_s = r.arrival_s
        # load proxy: what each worker received among the last `window` requests
        work = max(r.prompt_tokens - run.hit_blocks * bs, 1)
        work_pairs = prefill_pairs(work, r.prompt_tokens - work)
        recent.append((s, work, work_pairs))
        in_flight[s] += 1
        queued[s] += work
        pairs[s] += work_pairs
        ranks.report(
            s,
            in_flight=in_flight[s],
            queued_prefill_tokens=queued[s],
            queued_prefill_pairs=pairs[s],
        )
        if len(recent) > window:
            os, owork, opairs = recent.popleft()
            in_flight[os] -= 1
            queued[os] -= owork
            pairs[os] = max(pairs[os] - opairs, 0.0)
            ranks.report(
                os,
                in_flight=in_flight[os],
                queued_prefill_tokens=queued[os],
                queued_prefill_pairs=pairs[os],
            )
        if progress is not None and n % 256 == 0:
            progress(n)
    return records


def _vllm_load(engines: list[EngineModel]) -> Callable[[int], RankLoad]:
    def load(slot: int) -> RankLoad:
        eng = engines[slot]
        return RankLoad(len(eng.waiting), len(eng.running), eng.kv_usage)

    return load


@dataclass(slots=True)
class _Policies:
    """The policies acting in a timed run, and the workers registered so far (their
    targets)."""

    replicator: Replicator | None = None
    retainer: Retainer | None = None
    joined: set[int] = field(default_factory=set)

    def owns(self, rid: int) -> bool:
        """Whether `rid` is a policy's own request (no record, no route)."""
        if self.retainer is not None and self.retainer.is_touch(rid):
            return True
        return self.replicator is not None and self.replicator.is_replica(rid)

    def finished(self, run: Running) -> None:
        rid = run.req.rid
        if self.retainer is not None and self.retainer.is_touch(rid):
            self.retainer.finished(run)
        elif self.replicator is not None:
            self.replicator.finished(run)

    def due(
        self, now: float, index: IndexBackend, *, arrival: bool
    ) -> list[tuple[int, SimRequest]]:
        """The policies' requests to queue at `now`, with their engines. Replication
        decides at arrivals (it acts on their heat); retention at step ends too (an
        engine evicts only while it works, and a session waits out its tool call with no
        arrival of its own)."""
        out: list[tuple[int, SimRequest]] = []
        if arrival and self.replicator is not None and self.replicator.due(now):
            out += self.replicator.tick(now, index, self.joined)
        if self.retainer is not None and self.retainer.due(now):
            out += self.retainer.tick(now)
        return out


@dataclass(slots=True)
class _Step:
    start_s: float
    step_s: float
    steps: int
    chunks: list[tuple[Running, int]]
    decoders: list[Running]
    version: int


def _timed(
    workload: Workload,
    cp: Plane,
    ranks: _Ranks,
    engines: list[EngineModel],
    progress: Progress | None,
    joins: _Joins,
    policies: _Policies | None = None,
    slo: SLO | None = None,
    waiters: SloWaiters | None = None,
) -> list[Record]:
    policies = policies or _Policies()
    records: dict[int, Record] = {}
    order: list[Record] = []
    heap: list[tuple[float, int, int, int]] = []  # (end time, seq, worker, version)
    steps: list[_Step | None] = [None] * len(engines)
    versions = [0] * len(engines)
    seq = 0

    def start_step(w: int, now: float) -> None:
        nonlocal seq
        eng = engines[w]
        if not eng.has_work():
            steps[w] = None
            # idle now: the load it last reported (at its last step's start) still
            # counts the requests that step finished, and nothing else would clear it
            ranks.report(w, **eng.load())
            return
        step_s, k, chunks, decoders = eng.plan_step()
        if not chunks and not decoders:  # nothing admissible and nothing running
            steps[w] = None
            return
        # Admission may have taken cached blocks / loaded tiers: publish now.
        payload = eng.drain_events(now)
        if payload:
            ranks.ingest(w, payload)
        versions[w] += 1
        steps[w] = _Step(now, step_s, k, chunks, decoders, versions[w])
        seq += 1
        heapq.heappush(heap, (now + step_s * k, seq, w, versions[w]))
        ranks.report(w, **eng.load())

    def end_step(w: int, end: float, k: int) -> None:
        st = steps[w]
        assert st is not None
        eng = engines[w]
        finished = eng.apply_step(end, k, st.chunks, st.decoders, st.step_s)
        payload = eng.drain_events(end)
        if payload:
            ranks.ingest(w, payload)
        for run, _ in st.chunks:
            if run.first_token_s >= 0 and run.req.rid in records:
                cp.prefill_done(run.req.rid, now_s=run.first_token_s)
        for run in finished:
            if policies.owns(run.req.rid):
                policies.finished(run)  # not a workload request: no record, no route
                continue
            rec = records[run.req.rid]
            rec.hit_blocks = run.hit_blocks
            rec.first_token_s = run.first_token_s
            rec.finish_s = end
            if run in st.decoders:  # inside a macro step it finished at its own step
                own = run.req.output_tokens - (run.output_done - k)
                rec.finish_s = st.start_s + st.step_s * min(own, k)
            cp.finish(run.req.rid)
            arrivals.finished(run.req.rid, rec.finish_s, end)
        start_step(w, end)

    def queued(w: int, now: float) -> None:
        """Engine `w` got a request at `now`: report its load; start it, or cut its
        macro decode step at the step boundary after `now` so the request joins the
        next step."""
        nonlocal seq
        eng = engines[w]
        ranks.report(w, **eng.load())
        st = steps[w]
        if st is None:
            start_step(w, now)
        elif st.steps > 1:
            done = min(max(math.ceil((now - st.start_s) / st.step_s), 1), st.steps)
            if done < st.steps:
                st.steps = done
                versions[w] += 1
                st.version = versions[w]
                seq += 1
                heapq.heappush(heap, (st.start_s + st.step_s * done, seq, w, versions[w]))

    def serve(r: SimRequest, now: float, req_slo: SLO | None) -> tuple[Request, Decision | None]:
        """Route `r` at `now` with `req_slo` and queue it on its engine; the refusal, if
        the stage or the engine's capacity refused it."""
        request = _request(r, workload.parent_hints, req_slo)
        decision = cp.route(request, now)
        worker = decision.worker
        if worker is None:
            return request, decision
        if policies.replicator is not None:
            policies.replicator.observe(r, now)
        w = ranks.slot(decision, _vllm_load(engines))  # the engine slot from here on
        eng = engines[w]
        rec = records[r.rid]
        if not eng.fits_ever(r):
            cp.finish(r.rid)
            refuse(r, "prompt + output exceed the worker's KV capacity", now)
            return request, None
        rec.worker = worker
        _explained(rec, decision)
        eng.enqueue(r, _peer_end(decision))
        queued(w, now)
        if policies.retainer is not None:
            policies.retainer.turn(r, w, now)
        return request, None

    def refuse(r: SimRequest, reason: str, now: float) -> None:
        records[r.rid].rejected = reason
        arrivals.finished(r.rid, now, now)

    def retry(now: float) -> None:
        """The SLO queue's round: each waiter, in order, routed against what is left
        of its SLO; refused once waiting cannot help it any more."""
        assert waiters is not None
        for r, left in waiters.take(now):
            request, decision = serve(r, now, left)
            if decision is None:
                continue
            if waits(request, decision):
                waiters.keep(r)
            else:
                refuse(r, (decision.reason or "rejected") + " (after waiting)", now)

    arrivals = Arrivals(workload.requests)
    shared = _ParentShare(workload.requests)
    i = 0
    while arrivals or heap:
        next_arrival = arrivals.next_s()
        if heap and heap[0][0] <= next_arrival:
            end, _, done_w, ver = heapq.heappop(heap)
            if ver != versions[done_w]:
                continue  # superseded by a truncated macro step
            st = steps[done_w]
            assert st is not None
            end_step(done_w, end, st.steps)
            if policies.retainer is not None:
                for target, preq in policies.due(end, cp.index, arrival=False):
                    engines[target].enqueue(preq)
                    queued(target, end)
            if waiters is not None and waiters.due(end):
                retry(end)
            continue
        r = arrivals.pop()
        i += 1
        now = r.arrival_s
        rec = Record(r.rid, -1, now, r.prompt_tokens, r.prompt_blocks, r.output_tokens)
        rec.parent_blocks = shared(r)
        records[r.rid] = rec
        order.append(rec)
        joins.due(now)
        for target, preq in policies.due(now, cp.index, arrival=True):
            engines[target].enqueue(preq)
            queued(target, now)
        if waiters is not None and waiters.due(now):
            retry(now)
        request, decision = serve(r, now, slo)
        if decision is not None:
            if waiters is not None and waits(request, decision) and waiters.add(r, now):
                continue
            refuse(r, decision.reason or "rejected", now)
        if progress is not None and i % 256 == 0:
            progress(i)
    return order
