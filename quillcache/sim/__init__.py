"""The simulator: workloads, the engine model, the discrete-event runner and reports.

`quillcache simulate` (quillcache/sim/cli.py) is its command line; `docs/simulator.md`
describes the models and their assumptions.
"""

from __future__ import annotations

from quillcache.sim.engine import EngineModel
from quillcache.sim.generators import GENERATORS
from quillcache.sim.metrics import Record, RunResult
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.trace import load_trace
from quillcache.sim.workload import Workload

__all__ = [
    "GENERATORS",
    "EngineModel",
    "Record",
    "RunResult",
    "SimConfig",
    "Workload",
    "load_trace",
    "run",
]
