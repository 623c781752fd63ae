"""`/health` and `/ready`: the two questions an orchestrator asks a gateway.

- `/health` is liveness: the process serves HTTP. It answers 200 whatever the engines
  do: restarting a gateway because its engines are down brings no engine back, and with
  several replicas it would restart every one of them at once.
- `/ready` is readiness: the gateway routes as it should. 200 once at least one engine
  is routable (healthy, not draining) and every KV-event source of every routable
  engine has caught up (`SourceStatus.caught_up`: connected, and what its replay
  socket offered is applied, or a first batch off the wire went through the applier);
  else 503 with what is missing. A gateway that routes before it has caught up routes
  blind: every engine looks cold.

Engines that are down or draining get no traffic, so they are not waited for (listed
in the body), nor are configured engines that have not joined yet (`pending.py`);
their sources still count in the progress gauges. `caught_up` is a cold start latch: a
source that loses events later is repaired by replays and shown as stale
(`quillcache_kv_stale_sources`), it does not take the gateway out of service, which
would take every replica out at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from quillcache.connectors import SourceStatus
from quillcache.gateway.workers import Worker


@dataclass
class Readiness:
    routable: list[int] = field(default_factory=list)
    sources: int = 0  # event sources of every engine the gateway knows
    caught_up: int = 0  # of those, caught up
    # sources of routable engines that have not caught up: what /ready waits for
    waiting: list[dict[str, Any]] = field(default_factory=list)
    not_routable: list[dict[str, Any]] = field(default_factory=list)
    # the start-up bootstrap from a peer's snapshot (`bootstrap.BootstrapReport`), if any
    bootstrap: Any = None
    # configured engines not described yet (`pending.py`): like down engines, not waited
    # for, listed
    pending: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ready(self) -> bool:
        return bool(self.routable) and not self.waiting

    def missing(self) -> list[str]:
        """What stands between the gateway and ready, one sentence per item."""
        out = []
        if not self.routable:
            down = [f"{w['worker']} ({w['why']})" for w in self.not_routable]
            down += [f"{p['id']} (pending: {p['why']})" for p in self.pending]
            if down:
                out.append(f"no routable engine: workers {', '.join(down)}")
            else:
                out.append("no routable engine: no engine configured")
        for s in self.waiting:
            if not s["connected"]:
                why = f"not connected to {s['endpoint']}"
            else:
                why = f"replay from {s['replay_endpoint']} not finished"
            out.append(f"worker {s['worker']} ({s['url']}) rank {s['dp_rank']}: {why}")
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": "ready" if self.ready else "not ready",
            "missing": self.missing(),
            "routable_workers": self.routable,
            "sources": {"total": self.sources, "caught_up": self.caught_up},
            "waiting_for": self.waiting,
            "not_routable": self.not_routable,
            "pending": self.pending,
            **({"bootstrap": self.bootstrap.as_dict()} if self.bootstrap is not None else {}),
        }


def readiness(
    workers: Iterable[Worker], sources: Mapping[tuple[int, int], SourceStatus]
) -> Readiness:
    """The gateway's readiness from its workers and the ingestor's source states."""
    out = Readiness()
    for w in workers:
        if w.routable:
            out.routable.append(w.id)
        else:
            out.not_routable.append(
                {"worker": w.id, "url": w.url, "why": "down" if not w.healthy else "draining"}
            )
        for src in w.sources:
            status = sources.get((w.id, src.dp_rank))
            caught = status is not None and status.catching_up()
            out.sources += 1
            out.caught_up += caught
            if w.routable and not caught:
                out.waiting.append(
                    {
                        "worker": w.id,
                        "url": w.url,
                        "dp_rank": src.dp_rank,
                        "endpoint": src.endpoint,
                        "replay_endpoint": src.replay_endpoint,
                        "connected": status is not None and status.connected,
                        "replayed": status is not None and status.replayed_to_end,
                    }
                )
    return out
