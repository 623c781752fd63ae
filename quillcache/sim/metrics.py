"""Per-request records and the summary of one simulated run."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from quillcache.routing import SLO


@dataclass(slots=True)
class Record:
    """What happened to one request."""

    rid: int
    worker: int  # -1 when rejected
    arrival_s: float
    prompt_tokens: int
    prompt_blocks: int
    output_tokens: int
    hit_blocks: int = 0  # prefix blocks not recomputed (GPU hit + tier/peer loads)
    first_token_s: float = float("nan")
    finish_s: float = float("nan")
    rejected: str = ""
    # the decision beside the KV-optimal row (`quillcache.controlplane.explain`)
    avoided_tokens: int = 0  # the chosen engine's usable prefix
    avoidable_tokens: int = 0  # the longest usable prefix among the routable engines
    # the leading full blocks it shares with its first parent (the previous turn, the
    # planner); -1 without a parent
    parent_blocks: int = -1


def _pct(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q)) if len(a) else float("nan")


def _mean(a: np.ndarray) -> float:
    return float(a.mean()) if len(a) else float("nan")


def _r(x: float, nd: int = 6) -> float | None:
    return None if x != x else round(x, nd)  # NaN -> None (JSON null)


@dataclass
class RunResult:
    """The summary of one (router, backend[, sweep point]) run."""

    router: str
    backend: str
    timing: str
    workers: int
    capacity_blocks: int
    block_size: int
    records: list[Record]
    index_blocks: int = 0
    events_applied: int = 0
    match_ns: list[int] = field(default_factory=list)
    apply_ns: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    sweep: dict[str, Any] = field(default_factory=dict)
    kv_gib_per_engine: float = 0.0  # the capacity's KV memory (cost model's bytes/token)
    kv_exceeds_gpu: bool = False  # more than the cost model's GPU holds beside the weights
    # what a policy spent (`quillcache.sim.replicate.Replicator.stats`); empty: none ran
    policy: dict[str, Any] = field(default_factory=dict)
    # every request's SLO (`SimConfig.slo`), and whether the admission stage applied it
    slo: SLO | None = None
    admission: bool = True

    def summary(self, *, perf: bool = False) -> dict[str, Any]:
        """Deterministic metrics (same inputs and seed, same values); wall-clock ones
        (index latencies, wall time) only with `perf=True`."""
        recs = self.records
        served = [r for r in recs if not r.rejected]
        bs = self.block_size
        prompt_blocks = sum(r.prompt_blocks for r in served)
        hit_blocks = sum(r.hit_blocks for r in served)
        prompt_tokens = sum(r.prompt_tokens for r in served)
        hit_tokens = sum(min(r.hit_blocks * bs, r.prompt_tokens) for r in served)
        share = np.bincount(
            np.array([r.worker for r in served], dtype=np.int64), minlength=self.workers
        )[: self.workers]
        share_frac = share / max(len(served), 1)
        cv = float(share.std() / share.mean()) if share.mean() > 0 else 0.0
        out: dict[str, Any] = {
            "router": self.router,
            "backend": self.backend,
            "timing": self.timing,
            "workers": self.workers,
            "capacity_blocks": self.capacity_blocks,
            "kv_gib_per_engine": _r(self.kv_gib_per_engine, 2),
            "kv_exceeds_gpu": self.kv_exceeds_gpu,
            **self.sweep,
            "requests": len(recs),
            "rejected": len(recs) - len(served),
            "block_hit_rate": _r(hit_blocks / prompt_blocks if prompt_blocks else 0.0),
            "token_hit_rate": _r(hit_tokens / prompt_tokens if prompt_tokens else 0.0),
            "prefill_tokens_computed": prompt_tokens - hit_tokens,
            "prefill_tokens_saved": hit_tokens,
            "worker_share": [_r(float(x), 4) for x in share_frac],
            "worker_share_cv": _r(cv, 4),
            "index_blocks": self.index_blocks,
            "events_applied": self.events_applied,
            **_regret(served),
            **_followups(served),
        }
        if self.policy:
            computed = out["prefill_tokens_computed"]
            out.update(self.policy)
            for policy in ("replication", "retention"):
                spent = self.policy.get(f"{policy}_prefill_tokens")
                if spent is not None:
                    pct = 100.0 * spent / computed if computed else 0.0
                    out[f"{policy}_prefill_pct"] = _r(pct, 3)
        if self.timing == "full":
            ttft = np.array([r.first_token_s - r.arrival_s for r in served])
            e2e = np.array([r.finish_s - r.arrival_s for r in served])
            span = (
                max(r.finish_s for r in served) - min(r.arrival_s for r in served)
                if served
                else 0.0
            )
            out.update(
                ttft_mean_s=_r(_mean(ttft)),
                ttft_p50_s=_r(_pct(ttft, 50)),
                ttft_p99_s=_r(_pct(ttft, 99)),
                e2e_mean_s=_r(_mean(e2e)),
                e2e_p50_s=_r(_pct(e2e, 50)),
                e2e_p99_s=_r(_pct(e2e, 99)),
                throughput_rps=_r(len(served) / span if span > 0 else 0.0),
                output_tokens_per_s=_r(
                    sum(r.output_tokens for r in served) / span if span > 0 else 0.0
                ),
            )
            if self.slo is not None:
                out.update(_slo_report(self.slo, self.admission, recs, served))
            follow = np.array(
                [r.first_token_s - r.arrival_s for r in served if r.parent_blocks > 0]
            )
            if len(follow):
                out["followup_ttft_mean_s"] = _r(_mean(follow))
        if perf:
            m = np.array(self.match_ns, dtype=np.float64) / 1e3
            a = np.array(self.apply_ns, dtype=np.float64) / 1e3
            out.update(
                match_us_mean=_r(_mean(m), 2),
                match_us_p99=_r(_pct(m, 99), 2),
                apply_us_mean=_r(_mean(a), 2),
                apply_us_p99=_r(_pct(a, 99), 2),
                wall_s=_r(self.wall_s, 3),
            )
        return out


def _followups(served: list[Record]) -> dict[str, Any]:
    """Requests that follow a parent sharing part of their prefix (a session's next
    turn, an agent's calls after its planner): how many, and the share of those shared
    blocks they found cached (what keeping the parent's prefix on its engine, and
    routing the follow-up there, is for). Empty for a workload without any."""
    follow = [r for r in served if r.parent_blocks > 0]
    if not follow:
        return {}
    shared = sum(r.parent_blocks for r in follow)
    found = sum(min(r.hit_blocks, r.parent_blocks) for r in follow)
    return {"followups": len(follow), "followup_reuse_share": _r(found / shared)}


def _regret(served: list[Record]) -> dict[str, Any]:
    """The decisions beside the KV-optimal ones (docs/simulator.md): the share of served
    requests placed on an engine holding the longest usable prefix, and the prefill
    tokens another routable engine held that the chosen one did not (total, per
    request)."""
    avoidable = sum(r.avoidable_tokens for r in served)
    regret = avoidable - sum(r.avoided_tokens for r in served)
    optimal = sum(r.avoided_tokens == r.avoidable_tokens for r in served)
    return {
        "kv_optimal_share": _r(optimal / len(served) if served else 0.0),
        "prefill_tokens_avoidable": avoidable,
        "regret_tokens": regret,
        "regret_tokens_per_request": _r(regret / len(served) if served else 0.0, 2),
    }


def meets(rec: Record, slo: SLO) -> bool:
    """Whether a served request met every bound of `slo`: its TTFT, and its mean time
    between tokens over the decode (one output token has none)."""
    if slo.ttft_s is not None and rec.first_token_s - rec.arrival_s > slo.ttft_s:
        return False
    if slo.tbt_s is not None and rec.output_tokens > 1:
        tbt = (rec.finish_s - rec.first_token_s) / (rec.output_tokens - 1)
        if tbt > slo.tbt_s:
            return False
    return True


def _slo_report(
    slo: SLO, admission: bool, recs: list[Record], served: list[Record]
) -> dict[str, Any]:
    """The SLO's outcome: the share of the served requests that met it (with
    admission, the admitted ones: what the stage promises), and the share of all
    requests that were served and met it (goodput: a rejection is not a success)."""
    met = sum(meets(r, slo) for r in served)
    return {
        "slo_ttft_s": slo.ttft_s,
        "slo_tbt_s": slo.tbt_s,
        "slo_admission": admission,
        "slo_met_share": _r(met / len(served) if served else 0.0),
        "slo_goodput_share": _r(met / len(recs) if recs else 0.0),
    }
