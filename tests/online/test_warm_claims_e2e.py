"""Warm requests de-duplicated across gateway replicas (issue 19 §1): two replicas that
both pin one prefix (a client re-pinning through another replica) each keep and retain
it, but their retention touches claim one fleet-wide marker in Redis
(`quillcache.state.warm_claims`), so the fleet touches it about once per interval, not
once per replica. Real redis-server, engine simulator and gateways as processes."""

from __future__ import annotations

import time

import httpx

from tests.online.conftest import metric
from tests.online.fleet import Fleet, prompt
from tests.online.helpers import wait_for

WARMS = "quillcache_policy_warm_requests_total"
INTERVAL_S = 1.0  # touch_max_interval_s: an engine under no eviction pressure


def warms(fleet: Fleet, outcome: str) -> float:
    return sum(
        metric(
            httpx.get(r.url + "/metrics").text, WARMS + f'{{action="retain",outcome="{outcome}"}}'
        )
        for r in fleet.replicas
    )


def test_two_replicas_pinning_one_prefix_retain_it_once_per_interval(fleet: Fleet) -> None:
    fleet.stack.engine()
    policy = {
        "interval_s": 0.1,
        "touch_min_interval_s": 0.5,
        "touch_max_interval_s": INTERVAL_S,
    }
    replicas = [fleet.replica(router="round-robin", policy=policy) for _ in range(2)]
    text = prompt("pinned by both", blocks=8)
    for r in replicas:
        with fleet.admin(r) as a:
            got = a.post("/admin/pins", json={"model": "sim-model", "prompt": text, "ttl_s": 600})
            assert got.status_code == 200, got.text
    # placed once (a prefetch), then retained: wait for the touches to start
    wait_for(lambda: warms(fleet, "ok") >= 2, timeout=15.0, what="retention touches")
    start_ok, start_skipped = warms(fleet, "ok"), warms(fleet, "in_flight")
    window_s = 6.0
    time.sleep(window_s)
    touched = warms(fleet, "ok") - start_ok
    skipped = warms(fleet, "in_flight") - start_skipped
    # once per interval for the fleet (a tick's lateness either side), not once per replica
    assert window_s / INTERVAL_S - 2 <= touched <= window_s / INTERVAL_S + 1, (touched, skipped)
    assert skipped >= 1  # the other replica found the fleet's marker
    page = httpx.get(replicas[0].url + "/metrics").text
    assert metric(page, "quillcache_policy_fleet_claim_fallbacks_total") == 0
