"""Hot-prefix replication in the timed simulator (`quillcache.policy.replication`).

Every routed request is counted in a `HeatTracker`. At the first arrival at least
`period_s` after the last check, the hot prefixes (rate >= `min_rate`, at least
`min_blocks` blocks), their holders (the index's GPU match of the whole prefix, as the
router sees it) and each engine's queue wait (its queued prefill tokens at its cost
model's speed, what the engine reports to the gateway) go to a `ReplicationPolicy`.
Each `Replicate` is executed as the real actuator would: a request carrying the
prefix's tokens and one output token, queued on the target engine. It takes its turn in
the engine's scheduler, costs the engine that prefill and caches the blocks, which
reach the index as BlockStored events like any other. Its prefill tokens (the prompt
minus the target's cached prefix at admission) are the policy's cost, reported
beside the requests' own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from quillcache.errors import ConfigError
from quillcache.index import IndexBackend, KeyArray
from quillcache.policy.heat import HeatTracker
from quillcache.policy.replication import EngineLoad, ReplicationConfig, ReplicationPolicy
from quillcache.sim.engine import EngineModel, Running
from quillcache.sim.options import numeric_options
from quillcache.sim.requests import SimRequest

#: Replica requests' ids are at or below this (workload ids are >= 0, pins -1 - g).
REPLICA_RID_BASE = -(1 << 40)


@dataclass(frozen=True)
class ReplicateSettings:
    """The simulator's replication knobs: heat tracking, the check period and the
    policy's thresholds (`ReplicationConfig`)."""

    period_s: float = 0.5
    half_life_s: float = 5.0
    min_rate: float = 2.0  # requests a second
    min_blocks: int = 8
    max_entries: int = 4096
    # Low marks: the wait read is queued prefill only, and a hot prefix's requests hit,
    # so its holders' prefill queue stays short while their sequence slots and decode
    # batches fill; waiting for a long prefill queue replicates too late, onto one engine.
    high_wait_s: float = 0.1
    low_wait_s: float = 0.05
    cooldown_s: float = 1.0
    max_replicas: int = 3

    @classmethod
    def parse(cls, options: dict[str, Any]) -> ReplicateSettings:
        """From KEY=VALUE options (`--replicate-opt`, a grid cell's `replicate`)."""
        ints = frozenset({"min_blocks", "max_entries", "max_replicas"})
        s = cls(**numeric_options(cls, options, what="replication", ints=ints))
        s.check()
        return s

    def policy_config(self) -> ReplicationConfig:
        return ReplicationConfig(
            high_wait_s=self.high_wait_s,
            low_wait_s=self.low_wait_s,
            cooldown_s=self.cooldown_s,
            max_replicas=self.max_replicas,
        )

    def check(self) -> None:
        if not self.period_s > 0:
            raise ConfigError(f"replication period_s must be positive, got {self.period_s}")
        if not self.min_rate > 0:
            raise ConfigError(f"replication min_rate must be positive, got {self.min_rate}")
        if self.min_blocks <= 0:
            raise ConfigError(f"replication min_blocks must be positive, got {self.min_blocks}")
        self.policy_config().check()
        HeatTracker(half_life_s=self.half_life_s, max_entries=self.max_entries)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def prefix_request(src: SimRequest, blocks: int, rid: int, now_s: float) -> SimRequest:
    """A one-output-token request whose prompt is `src`'s first `blocks` full blocks."""
    bs = src.block_size
    return SimRequest(
        rid=rid,
        arrival_s=now_s,
        prompt_tokens=blocks * bs,
        output_tokens=1,
        keys=src.keys[:blocks],
        block_size=bs,
        tokens=None if src.tokens is None else src.tokens[: blocks * bs],
        block_ids=None if src.block_ids is None else src.block_ids[:blocks],
        keys_list=src.keys_list[:blocks],
        layout=None if src.layout is None else (src.layout[0][:blocks], src.layout[1][:blocks]),
    )


class Replicator:
    """Heat, policy and the replica requests of one timed run."""

    def __init__(
        self,
        settings: ReplicateSettings,
        engines: list[EngineModel],
        computing: Callable[[KeyArray], set[int]] | None = None,
    ) -> None:
        self.settings = settings
        self.computing = computing  # the plane's: where a routed request computes keys
        self.heat = HeatTracker(half_life_s=settings.half_life_s, max_entries=settings.max_entries)
        self.policy = ReplicationPolicy(settings.policy_config())
        self.engines = engines
        self._next_s = 0.0
        self._rids = itertools.count()
        # anchor key -> the last request seen carrying it (its tokens build the replica)
        self._source: dict[int, SimRequest] = {}
        self.replicas = 0
        self.replica_blocks = 0
        self.prefill_tokens = 0  # computed by finished replica requests

    @staticmethod
    def is_replica(rid: int) -> bool:
        return rid <= REPLICA_RID_BASE

    def observe(self, req: SimRequest, now_s: float) -> None:
        self.heat.observe(req.keys, now_s)
        d = 1
        while d <= len(req.keys_list):
            self._source[req.keys_list[d - 1]] = req
            d *= 2
        if len(self._source) > 2 * self.settings.max_entries:
            self._source = {k: r for k, r in self._source.items() if k in self.heat}

    def due(self, now_s: float) -> bool:
        return now_s >= self._next_s

    def tick(
        self, now_s: float, index: IndexBackend, routable: set[int]
    ) -> list[tuple[int, SimRequest]]:
        """The replica requests to queue now, with their engines."""
        s = self.settings
        self._next_s = now_s + s.period_s
        hot = self.heat.hot(now_s, s.min_rate, min_blocks=s.min_blocks)
        if not hot:
            return []
        loads = [EngineLoad(w, self.engines[w].queue_time()) for w in sorted(routable)]
        holders = {
            h.key: {
                m.worker for m in index.match(h.keys) if m.medium == "GPU" and m.blocks >= h.blocks
            }
            for h in hot
        }
        out = []
        of = self.computing
        computing = None if of is None else (lambda h: of(h.keys))  # asked only when needed
        for act in self.policy.decide(hot, holders, loads, now_s, computing):
            src = self._source.get(act.prefix_key)
            if src is None:  # cannot happen while the tracker holds the anchor
                continue
            rid = REPLICA_RID_BASE - next(self._rids)
            req = prefix_request(src, act.blocks, rid, now_s)
            if not self.engines[act.target_worker].fits_ever(req):
                continue
            self.replicas += 1
            self.replica_blocks += act.blocks
            out.append((act.target_worker, req))
        return out

    def finished(self, run: Running) -> None:
        """Count a finished replica request's prefill (prompt minus its cached prefix)."""
        self.prefill_tokens += run.req.prompt_tokens - run.hit_blocks * run.req.block_size

    def stats(self) -> dict[str, Any]:
        """What the run's summary reports (`RunResult.policy`)."""
        return {
            "replications": self.replicas,
            "replication_blocks": self.replica_blocks,
            "replication_prefill_tokens": self.prefill_tokens,
        }
