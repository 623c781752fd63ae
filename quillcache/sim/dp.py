"""Data-parallel ranks in the simulator: which rank of a worker serves a request.

Each worker is an engine with K data-parallel ranks. In vLLM's data parallelism every
rank is a full engine replica (its own scheduler and its own KV cache, sized from its
own GPU memory), so each rank here is its own `EngineModel` with the worker's full
capacity, publishing its events with its rank.

Two placements:

- `gateway`: the rank the decision names (`Decision.dp_rank`, sent as the
  `X-data-parallel-rank` header); what QuillCache does.
- `engine`: the gateway names only the worker and vLLM's front end places the request
  itself. vLLM's `DPLBAsyncMPClient.get_core_engine_for_request`
  (vllm/v1/engine/core_client.py) scores each rank by its waiting + running requests,
  adds `waiting * 6 * max(0, kv_cache_usage - 0.5)` when requests wait, takes the
  lowest score scanning from a start index that rotates by one per request (ties
  spread round-robin), and knows nothing of prefixes. The simulator gives it exact
  counts (vLLM's coordinator publishes them every 100 ms; one front end keeps its own
  in-flight count exact).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from quillcache.errors import ConfigError

Placement = Literal["gateway", "engine"]
PLACEMENTS: tuple[Placement, ...] = ("gateway", "engine")


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What vLLM's DP load balancer knows of one rank."""

    waiting: int
    running: int
    kv_usage: float


def check(ranks: int, placement: str) -> None:
    if ranks < 1:
        raise ConfigError(f"dp ranks must be >= 1, got {ranks}")
    if placement not in PLACEMENTS:
        raise ConfigError(f"dp placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")


class EnginePlacement:
    """vLLM's own rank choice for requests without a rank header (module docstring);
    one rotating start index per worker (one front end per engine)."""

    def __init__(self, workers: int, ranks: int) -> None:
        self._ranks = ranks
        self._start = [0] * workers

    def choose(self, worker: int, loads: list[RankLoad]) -> int:
        n = len(loads)
        best_score = float("inf")
        best = 0
        start = self._start[worker]
        for i in range(n):
            idx = (start + i) % n
            load = loads[idx]
            score = float(load.waiting + load.running)
            if load.waiting:
                score += load.waiting * 6.0 * max(0.0, load.kv_usage - 0.5)
            if score < best_score:
                best_score = score
                best = idx
        self._start[worker] = (start + 1) % n
        return best
