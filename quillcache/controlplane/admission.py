"""SLO admission: the control plane's stage after the router, the same for every router.

Mooncake's Conductor (FAST'25, §7 "overload-oriented scheduling") rejects a request
whose estimated TTFT or TBT on the instance it picked misses the SLO, rather than
serve it late. That check does not depend on how the instance was picked, so it runs
here, after any router's decision: the chosen engine (and rank) is estimated with the
view's cost model (`plan_and_estimate`, the estimate `Router.decide` attaches) and
the request is rejected, with the reason, when it misses its own SLO (`Request.slo`)
or, for a bound the request leaves unset, the router's default (`ttft_slo_s` /
`tbt_slo_s`, options every router takes by name: `quillcache.routing.default_slo`).
Without any bound nothing is estimated and the decision passes unchanged.

Whoever answers the client reads what a rejection missed with `missed` (the bound, the
estimate, the SLO and how long to wait before retrying), from the same comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from quillcache.routing import (
    SLO,
    Action,
    Decision,
    Estimate,
    Request,
    View,
    WorkerView,
    plan_and_estimate,
)


@dataclass(frozen=True, slots=True)
class SloMiss:
    """Which bound an estimate misses: the estimate and the SLO (seconds), and when a
    retry could meet it (`retry_after_s`, whole seconds, at least 1)."""

    bound: Literal["ttft", "tbt"]
    estimate_s: float
    slo_s: float
    retry_after_s: int
    # False when the estimate misses even with the queue drained (a TTFT miss whose
    # prefill and transfer alone exceed the SLO): waiting does not help
    waiting_helps: bool = True


def slo_miss(slo: SLO, est: Estimate) -> SloMiss | None:
    """The first bound of `slo` that `est` misses (TTFT before TBT), or None.

    Retry-After for a TTFT miss is the excess: the engine's queue drains in real time,
    so once that much of it is gone the same request would meet its SLO (the estimate's
    other parts, prefill and transfer, do not shrink with waiting; when they alone miss
    the SLO no wait helps: `waiting_helps` is False). A TBT miss depends on when running
    decodes end, which the estimate does not know: the least wait, 1 s."""
    if slo.ttft_s is not None and est.ttft_s > slo.ttft_s:
        excess = est.ttft_s - slo.ttft_s
        helps = est.ttft_s - est.queue_s <= slo.ttft_s
        return SloMiss("ttft", est.ttft_s, slo.ttft_s, max(1, math.ceil(excess)), helps)
    if slo.tbt_s is not None and est.tbt_s > slo.tbt_s:
        return SloMiss("tbt", est.tbt_s, slo.tbt_s, 1)
    return None


def missed(request: Request, decision: Decision, default: SLO | None) -> SloMiss | None:
    """What `decision` (a rejection) missed of the request's SLO, when the admission
    stage rejected it; None for a router's own rejection (no estimate, or one within
    the SLO)."""
    slo = effective_slo(request, default)
    if not decision.rejected or decision.estimate is None or slo is None:
        return None
    return slo_miss(slo, decision.estimate)


def effective_slo(request: Request, default: SLO | None) -> SLO | None:
    """The bounds `request` is held to: its own, each unset one taken from `default`."""
    own = request.slo
    if own is None:
        return default
    if default is None:
        return own
    return SLO(
        ttft_s=own.ttft_s if own.ttft_s is not None else default.ttft_s,
        tbt_s=own.tbt_s if own.tbt_s is not None else default.tbt_s,
    )


def loaded_estimate(request: Request, view: View, chosen: WorkerView) -> Estimate:
    """`plan_and_estimate`'s estimate on `chosen`, its queue term raised to what the
    engine's batching makes it: the queued prefill and this one share steps with the
    running decodes, which take budget and add their KV reads to every step, the step
    in progress is not joined and the request's last step is packed with later
    arrivals (`CostModel.packed_prefill_time`), and with every sequence slot taken the
    request waits for one (`slot_wait_time`). The plan's own queue term assumes the
    whole GPU for the queue; a router may rank engines with it, but admission promises a
    TTFT, and under overload (running decodes, full slots, packed steps) that term is
    the optimistic one."""
    steps, est = plan_and_estimate(request, view, chosen)
    cost = view.cost
    covered = max((s.end for s in steps if s.action is not Action.RECOMPUTE), default=0)
    cached = min(covered * view.block_size, request.prompt_tokens)
    new = max(request.prompt_tokens - cached, 1)
    loaded = cost.packed_prefill_time(
        queued_tokens=chosen.queued_prefill_tokens,
        queued_pairs=chosen.queued_prefill_pairs,
        new_tokens=new,
        context_tokens=request.prompt_tokens - new,
        running_decodes=chosen.running_decodes,
        mean_context_tokens=chosen.mean_context_tokens,
    )
    slot = cost.slot_wait_time(
        chosen.in_flight,
        chosen.running_decodes,
        chosen.mean_context_tokens,
        request.expected_output_tokens,
        chosen.max_num_seqs,
    )
    queue_s = chosen.pace * (loaded + slot) - est.prefill_s
    return replace(est, queue_s=max(queue_s, est.queue_s))


def admit(request: Request, view: View, decision: Decision, default: SLO | None) -> Decision:
    """`decision` when the chosen engine meets the request's SLO (or there is none, or
    the router rejected it already); otherwise a rejection saying which bound the
    estimate misses, carrying that estimate. `decision.dp_rank` names the rank (the
    plane has resolved it)."""
    if decision.worker is None:
        return decision
    slo = effective_slo(request, default)
    if slo is None or (slo.ttft_s is None and slo.tbt_s is None):
        return decision
    chosen = view.by_id(decision.worker, decision.dp_rank or 0)
    est = loaded_estimate(request, view, chosen)
    miss = slo_miss(slo, est)
    if miss is None:
        return decision
    where = f"worker {decision.worker}" + (f" rank {decision.dp_rank}" if decision.dp_rank else "")
    return Decision.reject(
        f"estimated {miss.bound.upper()} {_seconds(miss.estimate_s)} on {where} exceeds the "
        f"SLO {_seconds(miss.slo_s)}",
        est,
    )


def _seconds(s: float) -> str:
    """Seconds to the millisecond, or below 10 ms in milliseconds to three figures (a
    sub-millisecond SLO is not "0.000s")."""
    return f"{s:.3f}s" if s >= 0.01 else f"{s * 1000:.3g} ms"
