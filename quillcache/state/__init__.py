"""The state the gateway replicas of one fleet share through Redis (issue 16): booked
load per (engine, dp rank) under per-replica leases, the anti-herding booking step,
speculative placements, session bindings, pins, draining flags and engines added at
run time. Reference: docs/state.md."""

from quillcache.state.choose import choose, outsiders
from quillcache.state.redis_state import PinResult, RedisFleetState, default_replica_id, session_key
from quillcache.state.types import (
    Anchor,
    Booked,
    Candidate,
    Computing,
    EngineKey,
    FleetConfig,
    LoadWeights,
    LocalFallback,
    OutsideTerms,
    PinRecord,
    SecretMismatchError,
    Shared,
    SharedLoad,
    StateError,
    StateStats,
)

__all__ = [
    "Anchor",
    "Booked",
    "Candidate",
    "Computing",
    "EngineKey",
    "FleetConfig",
    "LoadWeights",
    "LocalFallback",
    "OutsideTerms",
    "PinRecord",
    "PinResult",
    "RedisFleetState",
    "SecretMismatchError",
    "Shared",
    "SharedLoad",
    "StateError",
    "StateStats",
    "choose",
    "default_replica_id",
    "outsiders",
    "session_key",
]
