"""Hot-prefix replication: place a hot prefix on one more engine when its holders are
overloaded and another engine is idle.

A router that follows the prefix cache sends every request of a popular prefix to the
engines holding it; once their queues are long, the prefix's requests wait while other
engines idle, and a cache-aware router only moves them when the wait outweighs a whole
recomputation. Computing the prefix once more on an idle engine (a one-token request
carrying it) makes that engine a holder: the next requests have a cheap choice. The idea
is Preble's (Srivatsa et al., "Preble: Efficient Distributed Prompt Scheduling for LLM
Serving", ICLR 2025, arXiv:2407.00023: a prefix whose load exceeds what its GPUs serve
is replicated onto lightly loaded ones) and Mooncake's (Qin et al., "Mooncake: A
KVCache-centric Disaggregated Architecture for LLM Serving", FAST 2025,
arXiv:2407.00079: the conductor replicates hot KVCache blocks to avoid hot spots); the
thresholds and hysteresis below are this module's own.

Decision, each time `decide` is called (hottest prefix first):
- a prefix becomes *active* when every holder's estimated queue wait exceeds
  `high_wait_s`, and inactive again when some holder's wait falls below `low_wait_s`
  (hysteresis: between the two marks it keeps its state);
- an active prefix gets one `Replicate` onto the engine with the shortest wait below
  `low_wait_s` that does not hold it (ties: lowest worker id), unless it was replicated
  less than `cooldown_s` ago or already has `max_replicas` extra replicas (those the
  policy made that still hold it, or were made within the cooldown: still in flight);
- an engine receives at most one replica per call (its wait does not show it yet);
- while a routed request computes the prefix on an engine that does not hold it
  (`computing`: the router has already spread the prefix's queue there), no replica is
  made: that engine is a holder once its prefill ends, and the holders' waits are then
  read again. A copy made beside the router's own spill doubles it: on the simulated
  hot-prefix burst it made the TTFT p99 worse where the router had spread the burst
  already (docs/results/simulator.md).
A prefix nobody holds is not replicated (routing places it). State is kept for the
prefixes passed in, and dropped for one absent from the input once its cooldown is over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from quillcache.errors import ConfigError
from quillcache.policy.heat import HotPrefix


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's estimated queue wait: its queued prefill tokens at the cost model's
    speed (the caller's estimate, e.g. `ControlPlane.queue_wait_s`)."""

    worker: int
    wait_s: float


@dataclass(frozen=True, slots=True)
class Replicate:
    """Place the prefix of `blocks` blocks ending in `prefix_key` on `target_worker`
    (a one-token request carrying it)."""

    prefix_key: int
    blocks: int
    target_worker: int


@dataclass(frozen=True, slots=True)
class ReplicationConfig:
    """The policy's knobs (module docstring)."""

    # Defaults as the simulator's (docs/simulator.md, "Policies"): low marks, since a
    # queued-prefill wait understates holders whose hits keep prefill short while
    # their decode slots fill.
    high_wait_s: float = 0.1  # every holder waits longer: the prefix is overloaded
    low_wait_s: float = 0.05  # an engine waiting less is idle; a holder waiting less ends it
    cooldown_s: float = 1.0  # at most one replica of a prefix this often
    max_replicas: int = 3  # extra replicas of one prefix at a time

    def check(self) -> None:
        for name, v in (
            ("high_wait_s", self.high_wait_s),
            ("low_wait_s", self.low_wait_s),
            ("cooldown_s", self.cooldown_s),
        ):
            if not (v >= 0 and math.isfinite(v)):
                raise ConfigError(f"replication {name} must be >= 0 and finite, got {v}")
        if self.low_wait_s > self.high_wait_s:
            raise ConfigError(
                f"replication low_wait_s ({self.low_wait_s}) must not exceed "
                f"high_wait_s ({self.high_wait_s})"
            )
        if self.max_replicas < 0:
            raise ConfigError(f"replication max_replicas must be >= 0, got {self.max_replicas}")


@dataclass(slots=True)
class _PrefixState:
    active: bool = False
    last_action_s: float = -math.inf
    made: dict[int, float] = field(default_factory=dict)  # target worker -> when


#: Who holds a prefix: a callable (e.g. from the index's match) or a mapping by key.
Holders = Callable[[HotPrefix], Collection[int]] | Mapping[int, Collection[int]]


class ReplicationPolicy:
    """Decides which hot prefixes to replicate onto which idle engine (module
    docstring). Pure: no I/O; the caller executes the returned actions."""

    def __init__(self, config: ReplicationConfig | None = None) -> None:
        self.config = config or ReplicationConfig()
        self.config.check()
        self._state: dict[int, _PrefixState] = {}

    def decide(
        self,
        hot: Iterable[HotPrefix],
        holders: Holders,
        loads: Sequence[EngineLoad],
        now_s: float,
        computing: Holders | None = None,
    ) -> list[Replicate]:
        """The replicas to make now. `hot`: the hot prefixes (`HeatTracker.hot`);
        `holders`: who holds each (engines outside `loads` are ignored); `loads`: every
        routable engine's wait; `computing`: the engines on which a routed request is
        computing each prefix right now (None: not known)."""
        cfg = self.config
        wait = {ld.worker: ld.wait_s for ld in loads}
        taken: set[int] = set()  # targets used in this call
        out: list[Replicate] = []
        seen: set[int] = set()
        for h in sorted(hot, key=lambda h: (-h.rate, -h.blocks, h.key)):
            if h.key in seen:
                continue
            seen.add(h.key)
            have = {w for w in _of(holders, h) if w in wait}
            st = self._state.get(h.key)
            if not have:
                continue
            if st is None:
                st = self._state[h.key] = _PrefixState()
            least = min(wait[w] for w in have)
            if least > cfg.high_wait_s:
                st.active = True
            elif least < cfg.low_wait_s:
                st.active = False
            if not st.active or now_s - st.last_action_s < cfg.cooldown_s:
                continue
            if computing is not None and any(
                w in wait and w not in have for w in _of(computing, h)
            ):
                continue  # the router's own spill is landing: read the waits after it
            st.made = {w: t for w, t in st.made.items() if w in have or now_s - t < cfg.cooldown_s}
            if len(st.made) >= cfg.max_replicas:
                continue
            idle = [
                (wait[w], w)
                for w in wait
                if w not in have and w not in taken and wait[w] < cfg.low_wait_s
            ]
            if not idle:
                continue
            _, target = min(idle)
            taken.add(target)
            st.last_action_s = now_s
            st.made[target] = now_s
            out.append(Replicate(h.key, h.blocks, target))
        for key in [k for k, s in self._state.items() if k not in seen]:
            s = self._state[key]
            if now_s - s.last_action_s >= cfg.cooldown_s:
                del self._state[key]
        return out


def _of(engines: Holders, prefix: HotPrefix) -> Collection[int]:
    """The engines `engines` names for `prefix`."""
    return engines.get(prefix.key, ()) if isinstance(engines, Mapping) else engines(prefix)
