"""Several gateway replicas in front of one simulated fleet (issue 16 §3).

`ReplicaFleet` stands where the simulator's single `ControlPlane` stands: the runner
routes, ingests and reports load through it exactly as through one plane. Behind it,
a load balancer hands each request to one of N replicas, each with its own
`ControlPlane` and its own router instance, and a *shadow* plane decides every request
too, without acting, so that each replica's choice can be compared with the choice of
one gateway that knows everything (routing precision).

What a replica knows, per `--replica-state`:

- `shared` (the design: events, plus learned state shared through Redis): its own
  exact index from every engine's events; the engines' load as booked fleet-wide (one
  `LoadStore` object read by every plane: the engine's own figures, as one gateway
  that books every request would hold them); speculative placements of every
  replica (one `SpeculativeBook`); session bindings (the routers' session homes).
- `private` (independent replicas): its own exact index from the events; its own
  requests' load exactly, the other replicas' load only as of the last metrics
  scrape (every `scrape_interval_s`, the gateway's default 1 s); its own speculation
  (the plane's) and its own router state.
- `approximate` (history-based routers, as SGLang's router and llm-d's approximate
  scorer): no events. After routing a request to engine E the replica records the
  request's full prompt blocks as held by E in a model of E's cache, evicted LRU at
  E's capacity (a `EngineModel` of E's size served instantly: the same LRU as the
  engine model, in the real event format through the real ingest path). Load as
  `private`.

The shadow: an exact index from the events, the engines' true load and the
speculative placements of every replica's actual decisions, with its own instance of
the router (seeded like replica 0's). Its router's internal state (round-robin
position, session homes) follows its own decisions, since it never acts.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from quillcache._native import PendingPrefixes
from quillcache.controlplane import ControlPlane, OpLatencies
from quillcache.controlplane.explain import explain
from quillcache.controlplane.load import LocalLoadStore
from quillcache.costmodel import CostModel, prefill_pairs
from quillcache.errors import ConfigError
from quillcache.index import ApplyStats, IndexBackend, KeyArray
from quillcache.index.inputs import as_key_array
from quillcache.routing import Decision, Request, Router, View, create_router
from quillcache.sim.engine import EngineModel, Running
from quillcache.sim.requests import SimRequest

ReplicaState = Literal["shared", "private", "approximate"]
REPLICA_STATES: tuple[str, ...] = ("shared", "private", "approximate")
LB_POLICIES: tuple[str, ...] = ("round-robin", "random")


#: The most gateway replicas a simulated fleet has (each runs its own control plane).
MAX_REPLICAS = 1024


@dataclass(frozen=True)
class ReplicaConfig:
    """How many replicas, what they share, how requests reach them."""

    replicas: int = 1
    state: str = "shared"
    lb: str = "round-robin"
    # private / approximate: how stale the other replicas' load is (the gateway
    # scrapes engine metrics every `scrape_interval_s`, default 1 s)
    scrape_interval_s: float = 1.0

    def check(self) -> None:
        if not 1 <= self.replicas <= MAX_REPLICAS:
            raise ConfigError(f"--replicas must be from 1 to {MAX_REPLICAS}, got {self.replicas}")
        if self.state not in REPLICA_STATES:
            raise ConfigError(
                f"unknown replica state {self.state!r}; known: {', '.join(REPLICA_STATES)}"
            )
        if self.lb not in LB_POLICIES:
            raise ConfigError(f"unknown load balancer {self.lb!r}; known: {', '.join(LB_POLICIES)}")
        if not self.scrape_interval_s > 0:
            raise ConfigError(f"scrape interval must be positive, got {self.scrape_interval_s}")


class LoadBalancer:
    """Which replica gets the n-th request: round-robin, or uniform random (seeded)."""

    def __init__(self, policy: str, replicas: int, seed: int) -> None:
        self.policy = policy
        self.replicas = replicas
        # its own stream, so that the routers' random draws do not depend on the LB
        self._rng = random.Random(f"lb-{seed}")
        self._next = 0

    def pick(self) -> int:
        if self.policy == "random":
            return self._rng.randrange(self.replicas)
        i = self._next
        self._next = (i + 1) % self.replicas
        return i


@dataclass(slots=True)
class _Placement:
    worker: int
    keys: npt.NDArray[np.uint64]
    expires_s: float
    prefilled: bool = False


class SpeculativeBook:
    """Speculative placements kept outside a plane: the prefixes being computed per
    worker, from routing until the prefill is done (or `ttl_s`). The same rule as the
    plane's own (`ControlPlane(speculative=True)`), so that one book read by several
    planes is the Redis layer's shared `spec:` entries, in process."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._pending = PendingPrefixes()
        self._placed: dict[int | str, _Placement] = {}
        self._next_expiry_s = math.inf

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, request: Request, worker: int, now_s: float) -> None:
        if request.request_id in self._placed:  # a retried id: the earlier one ends
            self.finish(request.request_id)
        keys = as_key_array(request.content_keys)
        p = _Placement(worker, keys, now_s + self.ttl_s)
        self._placed[request.request_id] = p
        self._next_expiry_s = min(self._next_expiry_s, p.expires_s)
        self._pending.add(worker, keys)

    def prefill_done(self, request_id: int | str) -> None:
        p = self._placed.get(request_id)
        if p is None or p.prefilled:
            return
        p.prefilled = True
        self._pending.remove(p.worker, p.keys)

    def finish(self, request_id: int | str) -> None:
        p = self._placed.pop(request_id, None)
        if p is not None and not p.prefilled:
            self._pending.remove(p.worker, p.keys)

    def fill(self, request: Request, view: View) -> None:
        """Write the request's pending prefix per worker into the view's column."""
        if view.now_s > self._next_expiry_s:
            self._expire(view.now_s)
        keys = request.content_keys
        if not len(self._pending) or not len(keys):
            return
        workers, blocks = self._pending.prefixes(as_key_array(keys))
        c = view.columns
        at = np.searchsorted(c.worker, workers)
        at = np.minimum(at, len(c.worker) - 1)
        ok = c.worker[at] == workers  # a removed worker's entries are not shown
        c.pending_blocks[at[ok]] = blocks[ok]

    def _expire(self, now_s: float) -> None:
        # a placement whose prefill_done never came lasts `ttl_s`, as in the plane
        self._next_expiry_s = math.inf
        for rid, p in list(self._placed.items()):
            if p.prefilled:
                continue
            if p.expires_s < now_s:
                p.prefilled = True
                self._pending.remove(p.worker, p.keys)
                del self._placed[rid]
            else:
                self._next_expiry_s = min(self._next_expiry_s, p.expires_s)


class BookRouter(Router):
    """A router that sees the speculative placements of a `SpeculativeBook` (the plane
    it runs in has speculation off): the composition that lets several planes read one
    book without a hook in the plane."""

    name = "book"

    def __init__(self, inner: Router, book: SpeculativeBook) -> None:
        super().__init__(seed=inner.seed)
        self.inner = inner
        self.book = book

    def route(self, request: Request, view: View) -> Decision:
        self.book.fill(request, view)
        return self.inner.route(request, view)


def share_sessions(routers: Sequence[Router]) -> None:
    """Make the routers hold one set of session homes (what the Redis layer's `sess:`
    keys give the replicas). Only routers that keep homes (`quillcache`) have any;
    consistent hashing (`session-affinity`) needs nothing shared."""
    first = routers[0]
    for attr in ("_homes", "_live"):
        if hasattr(first, attr):
            for r in routers[1:]:
                setattr(r, attr, getattr(first, attr))


# Load columns the replicas count per request (the additive ones).
_COUNTED = ("in_flight", "queued_prefill_tokens", "running_decodes", "queued_prefill_pairs")


def _queued(run: Running, waiting: bool, block_size: int) -> int:
    """The run's part of the engine's queued prefill tokens (engine.py's own rule)."""
    if waiting:
        return max(run.req.prompt_tokens - run.hit_blocks * block_size, 1)
    return max(run.req.prompt_tokens - run.computed, 0)


def _queued_pairs(run: Running, waiting: bool, block_size: int) -> float:
    """The attention pairs of the run's part (`EngineModel.queued_prefill_pairs`)."""
    new = _queued(run, waiting, block_size)
    return prefill_pairs(new, run.req.prompt_tokens - new) if new > 0 else 0.0


@dataclass
class _Scrape:
    """Per replica, per worker: the other replicas' counted load at the last scrape."""

    at_s: float = -math.inf
    others: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, 0, 0)))


class ReplicaFleet:
    """N replicas behind a load balancer plus a shadow, driven like one `ControlPlane`
    by the simulator's runner (route, ingest, update_load, prefill_done, finish)."""

    def __init__(
        self,
        config: ReplicaConfig,
        *,
        router: str | Router,
        router_options: dict[str, Any] | None,
        backend: str,
        cost: CostModel,
        block_size: int,
        speculative: bool,
        order_only: bool,
        seed: int,
        latencies: OpLatencies | None = None,
    ) -> None:
        config.check()
        self.config = config
        n = config.replicas
        self.state = config.state
        self.block_size = block_size
        self.speculative = speculative
        self.order_only = order_only
        self.lb = LoadBalancer(config.lb, n, seed)
        make = _router_factory(router, router_options)
        # replica 0 is seeded like the single-gateway run; the others differ, as
        # separate processes would
        inner = [make(seed + i) for i in range(n)]
        self.router_name = inner[0].name or type(inner[0]).__name__
        # the engines' load as they report it: the shadow's, and every shared replica's
        self.truth = LocalLoadStore()
        self._truth_rows: dict[int, dict[str, float]] = {}
        self.book: SpeculativeBook | None = None
        if speculative and self.state == "shared":
            self.book = SpeculativeBook(ttl_s=60.0)
        planes: list[ControlPlane] = []
        for i in range(n):
            r: Router = inner[i]
            if self.book is not None:
                r = BookRouter(r, self.book)
            planes.append(
                ControlPlane(
                    index=backend,
                    router=r,
                    cost=cost,
                    block_size=block_size,
                    # private replicas speculate on their own; a shared book replaces
                    # it; approximate replicas record a routed prefix as held at once
                    speculative=speculative and self.state == "private",
                    order_only=order_only,
                    load_store=self.truth if self.state == "shared" else None,
                    latencies=latencies if i == 0 else None,
                    # a BookRouter writes pending blocks into the view the plane built,
                    # rows `View.above_floor()` does not know: no pruned views
                    prune_min_rows=None if self.book is not None else 64,
                )
            )
        if self.state == "shared":
            share_sessions(inner)
        self.planes = planes
        # the shadow reads the actual placements of every replica (in `shared`, the
        # replicas' own book is exactly that)
        self.union = self.book
        if speculative and self.union is None:
            self.union = SpeculativeBook(ttl_s=60.0)
        shadow_router: Router = make(seed)
        if self.union is not None:
            shadow_router = BookRouter(shadow_router, self.union)
        self.shadow = ControlPlane(
            index=backend,
            router=shadow_router,
            cost=cost,
            block_size=block_size,
            speculative=False,
            order_only=order_only,
            load_store=self.truth,
            prune_min_rows=None if self.union is not None else 64,  # as the replicas'
        )
        self._owner: dict[int | str, int] = {}  # request id -> replica
        self._sim_requests: dict[int | str, SimRequest] = {}
        self._capacity: dict[int, int] = {}
        self._phantoms: list[dict[int, EngineModel]] = [{} for _ in range(n)]
        self._cost = cost
        self._engines: Sequence[EngineModel] = ()
        self._scrape = _Scrape()
        self.decisions = 0
        self.agreed = 0
        self.per_replica = [0] * n

    # --- what the runner calls, as on one plane -----------------------------------

    @property
    def index(self) -> IndexBackend:
        """Replica 0's index (for a report's block count)."""
        return self.planes[0].index

    @property
    def apply_stats(self) -> ApplyStats:
        return self.planes[0].apply_stats

    def attach(self, engines: Sequence[EngineModel]) -> None:
        """The engines, whose running requests say which replica's load is which."""
        self._engines = engines

    def add_worker(
        self,
        worker: int,
        *,
        capacity_blocks: int,
        model: str = "",
        max_num_seqs: int | None = None,
    ) -> None:
        for p in [*self.planes, self.shadow]:
            p.add_worker(
                worker, capacity_blocks=capacity_blocks, model=model, max_num_seqs=max_num_seqs
            )
        self._capacity[worker] = capacity_blocks

    def ingest(self, worker: int, payloads: Sequence[bytes]) -> None:
        self.shadow.ingest(worker, payloads)
        if self.state == "approximate":
            return  # no events: the replicas learn from their own decisions
        for p in self.planes:
            p.ingest(worker, payloads)

    def update_load(self, worker: int, **load: float) -> None:
        # one store: the shadow's, and in `shared` every replica's
        self.shadow.update_load(worker, **load)
        self._truth_rows[worker] = load

    def route(self, request: Request, now_s: float = 0.0) -> Decision:
        i = self.lb.pick()
        plane = self.planes[i]
        if self.state != "shared" and len(self.planes) > 1:
            self._private_load(i, now_s)
        elif self.state != "shared":
            for worker, load in self._truth_rows.items():  # one replica: no one else's load
                plane.update_load(worker, **load)
        decision = plane.route(request, now_s)
        # regret against the fleet's index (the shadow's view: every event, and the
        # placements of every replica pending), not what the deciding replica knew
        truth = self.shadow.view(request, now_s)
        if self.union is not None:
            self.union.fill(request, truth)
        why = explain(request, truth, decision, every_row=True)
        decision = replace(decision, explanation=why)
        shadow = self.shadow.route(request, now_s)
        self.decisions += 1
        self.per_replica[i] += 1
        self.agreed += shadow.worker == decision.worker
        chosen = decision.worker
        if chosen is None:
            return decision
        self._owner[request.request_id] = i
        if self.union is not None:  # in `shared`, the replicas' own book
            self.union.add(request, chosen, now_s)
        if self.state == "approximate":
            self._learn(i, chosen, request)
        return decision

    def prefill_done(self, request_id: int | str, now_s: float | None = None) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            self.planes[i].prefill_done(request_id, now_s)
        if self.union is not None:
            self.union.prefill_done(request_id)

    def finish(self, request_id: int | str) -> None:
        i = self._owner.pop(request_id, None)
        if i is not None:
            self.planes[i].finish(request_id)
        if self.union is not None:
            self.union.finish(request_id)

    def computing(self, keys: KeyArray) -> set[int]:
        """Where a request routed by any replica is computing all of `keys` (each
        replica's plane knows its own requests)."""
        return set().union(*(p.computing(keys) for p in self.planes))

    def close(self) -> None:
        for p in [*self.planes, self.shadow]:
            p.close()

    @property
    def precision(self) -> float:
        return self.agreed / self.decisions if self.decisions else 1.0

    # --- approximate: the index learned from routing -----------------------------

    def _learn(self, replica: int, worker: int, request: Request) -> None:
        """Record the request's prompt as held by `worker` in the replica's model of
        its cache (LRU at the engine's capacity), through events into its index."""
        phantoms = self._phantoms[replica]
        model = phantoms.get(worker)
        if model is None:
            model = phantoms[worker] = EngineModel(
                worker,
                capacity_blocks=self._capacity[worker],
                block_size=self.block_size,
                cost=self._cost,
            )
        sim = self._sim_requests.get(request.request_id)
        if sim is None:
            return
        _, payload = model.serve_instantly(sim)
        if payload:
            self.planes[replica].ingest(worker, [payload])

    def know(self, requests: Sequence[SimRequest]) -> None:
        """The workload's requests by id (approximate replicas replay them on their
        cache models: the router sees a `Request`, whose tokens the model needs)."""
        self._sim_requests = {r.rid: r for r in requests}

    # --- private / approximate: own load fresh, others' as of the last scrape ----

    def _counted(self) -> npt.NDArray[np.float64]:
        """(replica, worker, counted field): each replica's requests' load now."""
        n = len(self.planes)
        out = np.zeros((n, len(self._engines), len(_COUNTED)), dtype=np.float64)
        owner = self._owner
        bs = self.block_size
        for w, eng in enumerate(self._engines):
            for waiting, runs in ((True, eng.waiting), (False, eng.running)):
                for run in runs:
                    i = owner.get(run.req.rid)
                    if i is None:
                        continue
                    row = out[i, w]
                    row[0] += 1
                    row[1] += _queued(run, waiting, bs)
                    if not waiting and run.computed >= run.req.prompt_tokens:
                        row[2] += 1
                    row[3] += _queued_pairs(run, waiting, bs)
        return out

    def _private_load(self, replica: int, now_s: float) -> None:
        """What replica `replica` sees: the engines' figures, less what the other
        replicas changed since the last scrape (its own requests are always fresh)."""
        counted = self._counted()
        others_now = counted.sum(axis=0)[None] - counted  # (replica, worker, field)
        sc = self._scrape
        interval = self.config.scrape_interval_s
        if sc.others.shape != others_now.shape or now_s >= sc.at_s + interval:
            # scrapes fall on multiples of the interval; this one is taken at the first
            # arrival after its boundary (engine steps are far shorter than 1 s)
            sc.at_s = math.floor(now_s / interval) * interval
            sc.others = others_now
        plane = self.planes[replica]
        delta = others_now[replica] - sc.others[replica]
        for w, load in self._truth_rows.items():
            seen = dict(load)
            for k, name in enumerate(_COUNTED):
                if name in seen:
                    seen[name] = max(seen[name] - float(delta[w, k]), 0.0)
            plane.update_load(w, **seen)


def _router_factory(
    router: str | Router, options: dict[str, Any] | None
) -> Callable[[int], Router]:
    if isinstance(router, str):
        return lambda seed: create_router(router, seed=seed, **(options or {}))
    # a router object: each replica (and the shadow) gets its own copy
    return lambda seed: copy.deepcopy(router)
