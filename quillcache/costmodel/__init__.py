"""The cost model: prefill, decode, transfer and queueing time estimates (see docs/simulator.md)."""

from __future__ import annotations

from quillcache.costmodel.config import (
    CostModelConfig,
    EngineSpec,
    GpuSpec,
    ModelSpec,
    TransferSpec,
)
from quillcache.costmodel.model import CostModel, TtftEstimate, booked_pairs, prefill_pairs

__all__ = [
    "CostModel",
    "CostModelConfig",
    "EngineSpec",
    "GpuSpec",
    "ModelSpec",
    "TransferSpec",
    "TtftEstimate",
    "booked_pairs",
    "prefill_pairs",
]
