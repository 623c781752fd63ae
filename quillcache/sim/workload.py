"""A workload: requests in arrival order plus what identifies their namespace."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from quillcache.identity import namespace
from quillcache.sim.requests import SimRequest

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

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def scaled(self, time_scale: float) -> Workload:
        """Arrivals multiplied by `time_scale` (< 1 compresses: a higher request rate)."""
        if time_scale == 1.0:
            return self
        reqs = [replace(r, arrival_s=r.arrival_s * time_scale) for r in self.requests]
        return Workload(
            self.name,
            reqs,
            self.block_size,
            self.model,
            self.pinned,
            {**self.params, "time_scale": time_scale},
        )
