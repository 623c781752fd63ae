"""The control plane: workers, event ingest, routing (see `plane.py` for the API)."""

from __future__ import annotations

from quillcache.controlplane.load import LoadStore, LocalLoadStore
from quillcache.controlplane.plane import (
    ControlPlane,
    OpLatencies,
    RouterContractError,
    UnknownSourceError,
    UnknownWorkerError,
    WorkerState,
)

__all__ = [
    "ControlPlane",
    "LoadStore",
    "LocalLoadStore",
    "OpLatencies",
    "RouterContractError",
    "UnknownSourceError",
    "UnknownWorkerError",
    "WorkerState",
]
