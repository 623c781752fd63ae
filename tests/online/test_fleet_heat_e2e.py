"""Hot-prefix replication through two gateway replicas that share their heat (issue 19
§1): each replica sees half of a burst on one tenant's system prompt, below `min_rate`
on its own, while the fleet's rate, summed in Redis (`WarmClaims.share_heat`), is above
it. The shared fleet replicates the prefix onto the idle engine once; two replicas on
local state, under the same traffic, never do. Real redis-server, engine simulators
and gateways as processes, the official `openai` client.

The margins: with a half-life of 30 s (a decay time of 43 s) a burst of 64 requests
gives each replica a rate of at most 32 / 43 = 0.74 requests a second, under `min_rate`
1.1 by 1.5x whatever the timing, and the fleet about twice that while the burst lasts
well under the decay time."""

from __future__ import annotations

import itertools
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from quillcache.gateway.tenancy import hash_key
from quillcache.up import Proc
from tests.online.conftest import metric
from tests.online.fleet import Fleet
from tests.online.test_replication_e2e import BLOCK, KEYS, SYSTEM, SYSTEM_BLOCKS, served_by, text

WARMS = "quillcache_policy_warm_requests_total"
BURST = 64
POLICY = {
    "interval_s": 0.1,
    "replication": {
        "enabled": True,
        "min_rate": 1.1,
        "half_life_s": 30.0,
        "min_blocks": 4,
        "cooldown_s": 0.5,
    },
}


def _gateways(fleet: Fleet, shared: bool) -> list[Proc]:
    for _ in range(2):
        fleet.stack.engine(extra=["--max-num-seqs", "2"])
    config: dict[str, object] = {
        "router": "sglang",
        "api_keys": [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items()],
        "policy": POLICY,
    }
    if shared:
        # a shortlist of one: the booking books the router's choice, so only a replica
        # can put the prefix on the other engine (with longer shortlists the booking
        # itself moves requests off a holder over its ceiling, and the prefix with them:
        # anti-herding, which is not what this test measures)
        return [fleet.replica(**config, state_shortlist=1) for _ in range(2)]
    return [fleet.stack.start_gateway(config) for _ in range(2)]


def _burst(gateways: list[Proc]) -> tuple[list[tuple[int, int]], list[str], int]:
    """The served (worker, cached tokens) of the burst, sent to the gateways in turn,
    each gateway's metrics after it, and the engine the prefix went to first."""
    clients = [
        openai.OpenAI(base_url=g.url + "/v1", api_key="k-acme", max_retries=0) for g in gateways
    ]
    first, _ = served_by(clients[0], SYSTEM + " the first request", max_tokens=1)
    turn = itertools.cycle(clients)
    jobs = [(next(turn), i) for i in range(BURST)]
    with ThreadPoolExecutor(16) as pool:
        served = list(
            pool.map(
                lambda j: served_by(j[0], SYSTEM + f" request {j[1]} " + text(f"q{j[1]}", 8)), jobs
            )
        )
    pages = [httpx.get(g.url + "/metrics").text for g in gateways]
    return served, pages, first


def _policy_lines(page: str) -> list[str]:
    """What a replica's policy did (said when an assertion fails)."""
    wanted = (WARMS, "quillcache_policy_decisions", "quillcache_policy_heat", "quillcache_state")
    return [line for line in page.splitlines() if line.startswith(wanted)]


def _replicated(pages: list[str]) -> float:
    return sum(metric(p, WARMS + '{action="replicate",outcome="ok"}') for p in pages)


def test_two_replicas_replicate_a_prefix_hot_only_for_the_fleet(fleet: Fleet) -> None:
    served, pages, holder = _burst(_gateways(fleet, shared=True))
    assert [metric(p, "quillcache_policy_heat_replicas") for p in pages] == [2, 2]
    # hot for the fleet: copied once onto the idle engine (the in-flight marker and the
    # index keep the other replica from copying it again)
    assert _replicated(pages) == 1, [_policy_lines(p) for p in pages]
    idle = 1 - holder
    on_copy = [cached for worker, cached in served if worker == idle]
    assert on_copy and max(on_copy) >= (SYSTEM_BLOCKS // 2) * BLOCK


def test_two_replicas_on_local_state_see_half_the_heat_and_never_replicate(
    fleet: Fleet,
) -> None:
    served, pages, holder = _burst(_gateways(fleet, shared=False))
    assert [metric(p, "quillcache_policy_heat_replicas") for p in pages] == [1, 1]
    assert _replicated(pages) == 0
    assert all(cached < BLOCK * 4 for worker, cached in served if worker != holder)
