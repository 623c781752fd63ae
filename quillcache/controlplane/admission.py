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
"""

from __future__ import annotations

from quillcache.routing import SLO, Decision, Request, View, plan_and_estimate


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
    _, est = plan_and_estimate(request, view, chosen)
    where = f"worker {decision.worker}" + (f" rank {decision.dp_rank}" if decision.dp_rank else "")
    if slo.ttft_s is not None and est.ttft_s > slo.ttft_s:
        return Decision.reject(
            f"estimated TTFT {est.ttft_s:.3f}s on {where} exceeds the SLO {slo.ttft_s:.3f}s", est
        )
    if slo.tbt_s is not None and est.tbt_s > slo.tbt_s:
        return Decision.reject(
            f"estimated TBT {est.tbt_s:.3f}s on {where} exceeds the SLO {slo.tbt_s:.3f}s", est
        )
    return decision
