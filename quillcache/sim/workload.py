"""A workload: requests in arrival order plus what identifies their namespace."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quillcache.errors import ConfigError
from quillcache.identity import namespace
from quillcache.sim.requests import KeyChainer, SimRequest, attach_layouts, make_request

DEFAULT_MODEL = "sim-model"


def sim_namespace(block_size: int, model: str = DEFAULT_MODEL) -> int:
    """The namespace the simulated engines' events resolve to in the index: the
    worker's registered model, no tokenizer/LoRA/tenant, the events' block size."""
    return namespace(model, "", "", "", block_size)


@dataclass
class Workload:
    name: str
    requests: list[SimRequest]
    block_size: int
    model: str = DEFAULT_MODEL
    pinned: list[SimRequest] = field(default_factory=list)  # prefixes every engine pins
    params: dict[str, object] = field(default_factory=dict)  # for reports
    chained_ids: bool = False  # block-id requests: equal id at a position = equal prefix
    # routers are told the request each one follows (`Request.parent_id`: its first
    # parent, closed loop only); False: what clients that send no parent hint give
    parent_hints: bool = True

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    @property
    def closed_loop(self) -> bool:
        """Whether some request waits for others to finish (`quillcache.sim.release`)."""
        return any(r.parents for r in self.requests)

    def open_loop(self) -> Workload:
        """The same requests at their open-loop times: nobody waits for a parent (how
        the multi-turn and agent generators were replayed before closed loop)."""
        if not self.closed_loop:
            return self
        reqs = [replace(r, parents=(), wait_s=0.0) for r in self.requests]
        return replace(self, requests=reqs, params={**self.params, "closed_loop": False})

    def without_sessions(self) -> Workload:
        """The same requests with no session id: what a router sees from clients that
        send no session hint (to measure what the hint is worth)."""
        if all(r.session_id is None for r in self.requests):
            return self
        reqs = [replace(r, session_id=None) for r in self.requests]
        return replace(self, requests=reqs, params={**self.params, "session_ids": False})

    def without_parent_hints(self) -> Workload:
        """The same requests, released as before, but routed with no parent request
        (`Request.parent_id`): to measure what the DAG hint is worth."""
        return replace(self, params={**self.params, "parent_hints": False}, parent_hints=False)

    def scaled(self, time_scale: float) -> Workload:
        """Arrivals multiplied by `time_scale` (< 1 compresses: a higher request rate),
        and so are closed-loop think / tool times: the client runs that much faster."""
        if time_scale == 1.0:
            return self
        reqs = [
            replace(r, arrival_s=r.arrival_s * time_scale, wait_s=r.wait_s * time_scale)
            for r in self.requests
        ]
        return replace(self, requests=reqs, params={**self.params, "time_scale": time_scale})

    def with_engine_blocks(self, engine_block_size: int) -> Workload:
        """The same requests on an engine whose KV blocks hold `engine_block_size`
        tokens, a divisor of the workload's block size: each workload block becomes
        `k = block_size // engine_block_size` engine blocks, and keys, capacity, hits,
        events and the index all count engine blocks from then on.

        Token-carrying requests are keyed again from their tokens. A block id `x`
        (traces) becomes the ids `x * k + j`, `j < k`, one per engine block: distinct
        ids for distinct parts, equal where the trace's ids are equal, and still
        chained when the trace's ids are. Full engine blocks inside a trailing partial
        trace block become cacheable, as they would be on such an engine.
        """
        coarse = self.block_size
        if engine_block_size == coarse:
            return self
        if engine_block_size <= 0 or coarse % engine_block_size:
            would = ", ".join(str(d) for d in range(1, coarse + 1) if coarse % d == 0)
            raise ConfigError(
                f"engine.block_size {engine_block_size} does not divide the workload's "
                f"block size {coarse} (a trace's --trace-block-size, a generator's "
                f"--block-size): each of its blocks must map to whole engine blocks; "
                f"would work: {would}"
            )
        k = coarse // engine_block_size
        ns = sim_namespace(engine_block_size, self.model)
        chainer = KeyChainer(ns, engine_block_size, chained=self.chained_ids)

        def refine(r: SimRequest) -> SimRequest:
            fine_ids = None
            if r.block_ids is not None:
                fine_ids = [x * k + j for x in r.block_ids for j in range(k)]
            return make_request(
                r.rid,
                r.arrival_s,
                r.output_tokens,
                engine_block_size,
                ns,
                tokens=r.tokens,
                block_ids=fine_ids,
                prompt_tokens=r.prompt_tokens,
                chainer=chainer if fine_ids is not None else None,
                session_id=r.session_id,
                parents=r.parents,
                wait_s=r.wait_s,
            )

        reqs = [refine(r) for r in self.requests]
        pinned = [refine(r) for r in self.pinned]
        attach_layouts(reqs, engine_block_size)
        return replace(
            self,
            requests=reqs,
            block_size=engine_block_size,
            pinned=pinned,
            params={**self.params, "engine_block_size": engine_block_size},
        )
