"""The control plane: workers, event ingest, routing (see `plane.py` for the API)."""

from __future__ import annotations

from quillcache.controlplane.plane import (
    ControlPlane,
    RouterContractError,
    UnknownWorkerError,
    WorkerState,
)

__all__ = ["ControlPlane", "RouterContractError", "UnknownWorkerError", "WorkerState"]
