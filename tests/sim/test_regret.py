"""The simulator's regret (docs/simulator.md): each run's KV-optimal share and the
prefill tokens its choices left that another routable engine held, in the summary, the
table and the matrix's page.

Independent checks: in order-only replay without peer fetch, what the explanation says
the chosen engine avoids is what the engine model then hits (the index and the engine
agree on each block); a router that always picks the longest usable prefix has no
regret, whatever the workload; round-robin does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.routing import Router
from quillcache.routing.types import Decision, Request, View
from quillcache.sim.generators import GENERATORS
from quillcache.sim.runner import SimConfig, run
from tests.sim.test_matrix import TINY, _matrix


class LongestPrefix(Router):
    """The first row holding the longest prefix (local tiers or pending) of the request."""

    name = "longest-prefix"

    def route(self, request: Request, view: View) -> Decision:
        c = view.columns
        held = np.minimum(np.maximum(c.local_blocks, c.pending_blocks), len(request.content_keys))
        return self.decide(request, view, view.worker_at(int(np.argmax(held))))


def _no_peer_cost() -> CostModel:
    config = CostModelConfig()
    config.transfer.allow_peer_fetch = False
    return CostModel(config)


@pytest.mark.parametrize("workload", ["multi-turn", "shared-prefix", "agent-fanout"])
def test_order_only_avoided_tokens_are_the_engines_hits(workload: str) -> None:
    wl = GENERATORS[workload](seed=1)
    wl.requests = wl.requests[:600]
    res = run(wl, "round-robin", "native", SimConfig(workers=4, timing="none"), _no_peer_cost())
    bs = wl.block_size
    served = [r for r in res.records if not r.rejected]
    assert served
    for r in served:
        assert r.avoided_tokens == min(r.hit_blocks * bs, r.prompt_tokens), r.rid
        assert r.avoidable_tokens >= r.avoided_tokens
    s = res.summary()
    assert s["regret_tokens"] == sum(r.avoidable_tokens - r.avoided_tokens for r in served)
    assert s["prefill_tokens_avoidable"] == sum(r.avoidable_tokens for r in served)
    assert s["regret_tokens"] > 0  # round-robin leaves prefixes behind


@pytest.mark.parametrize("timing", ["none", "full"])
def test_the_longest_prefix_router_has_no_regret(timing: str) -> None:
    wl = GENERATORS["multi-turn"](seed=2, sessions=40)
    res = run(wl, LongestPrefix(), "native", SimConfig(workers=4, timing=timing), CostModel())
    s = res.summary()
    assert s["kv_optimal_share"] == 1.0
    assert s["regret_tokens"] == 0 and s["regret_tokens_per_request"] == 0.0
    assert s["prefill_tokens_avoidable"] > 0
    rr = run(wl, "round-robin", "native", SimConfig(workers=4, timing=timing), CostModel())
    assert rr.summary()["regret_tokens_per_request"] > 0
    assert rr.summary()["kv_optimal_share"] < 1.0


def test_replicas_measure_regret_against_the_fleets_index() -> None:
    from quillcache.sim.replicas import ReplicaConfig

    wl = GENERATORS["shared-prefix"](requests=300, prefix_groups=6, seed=3)
    res = run(
        wl,
        "round-robin",
        "native",
        SimConfig(workers=4),
        CostModel(),
        replicas=ReplicaConfig(replicas=2, state="private"),
    )
    s = res.summary()
    assert 0.0 < s["kv_optimal_share"] < 1.0 and s["regret_tokens"] > 0


def test_matrix_page_has_each_routers_regret(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    proc = _matrix("--matrix", "tiny.toml", "--jobs", "1", "--out", "a", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    results = json.loads((tmp_path / "a" / "matrix.json").read_text())
    page = (tmp_path / "a" / "matrix.md").read_text()
    assert "| KV-optimal | regret (tokens/req) |" in page
    for c in results["cells"]:
        for name, r in c["routers"].items():
            runs = [x for x in c["runs"] if x["router"] == name]
            mean = sum(x["regret_tokens_per_request"] for x in runs) / len(runs)
            assert r["regret_tokens_per_request"] == pytest.approx(mean, abs=0.01)
            row = next(
                line
                for line in page.split(f"#### {c['name']}\n", 1)[1].splitlines()
                if line.startswith(f"| {name}")
            )
            assert row.rstrip(" |").endswith(f"{r['regret_tokens_per_request']:,.1f}")
