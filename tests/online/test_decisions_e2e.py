"""Explained decisions online: three engine simulators behind a round-robin gateway.

A prompt's prefix lands on one engine (its events reach the index); the same prefix
with a new tail is then routed by round-robin to another engine. The sampled decision
log (`GET /admin/decisions`) names the holder as KV-optimal and the chosen engine's
regret, and the Prometheus counters grow by the avoidable and avoided tokens; the
endpoint refuses a client without the admin token.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quillcache.tokenization.local import ByteTokenizer
from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import http_get, http_post, wait_for

BLOCK = 16  # the engine simulator's block size


@pytest.fixture
def three(tmp_path: Path) -> Iterator[Stack]:
    for s in make_stack(tmp_path):
        for _ in range(3):
            s.engine()
        s.start_gateway({"router": "round-robin"})
        yield s


def prompt(blocks: int) -> str:
    text = ("[decisions-e2e] a prefix one engine holds " * 30)[: blocks * BLOCK]
    assert len(ByteTokenizer().encode(text)) == blocks * BLOCK
    return text


def counters(url: str) -> dict[str, float]:
    page = http_get(url + "/metrics").text
    return {
        name: metric(page, name)
        for name in (
            "quillcache_decisions_kv_optimal_total",
            "quillcache_prefill_tokens_avoidable_total",
            "quillcache_prefill_tokens_avoided_total",
        )
    }


def test_a_held_prefix_is_the_kv_optimal_choice_in_the_log_and_counters(three: Stack) -> None:
    gw = three.gateway
    assert gw is not None
    admin = three.admin()
    blocks = 10
    prefix = prompt(blocks)
    first = http_post(gw.url + "/v1/completions", json={"prompt": prefix, "max_tokens": 2})
    assert first.status_code == 200, first.text
    holder = int(first.headers["x-quillcache-worker"])
    wait_for(
        lambda: any(
            m["worker"] == holder and m["blocks"] == blocks
            for m in admin.post("/admin/lookup", json={"prompt": prefix}).json()["matches"]
        ),
        what="the index to learn the prefix from the engine's events",
    )
    before = counters(gw.url)
    follow = prefix + " and then a question of its own"
    time.sleep(0.1)  # the log samples at most one decision per 50 ms
    answer = http_post(gw.url + "/v1/completions", json={"prompt": follow, "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    chosen = int(answer.headers["x-quillcache-worker"])
    assert chosen != holder  # round-robin moved on

    log = admin.get("/admin/decisions").json()
    last = log["decisions"][-1]
    avoidable = blocks * BLOCK
    assert last["kv_optimal"] == [holder, 0]
    assert last["chosen"] == [chosen, 0]
    assert last["kv_optimal_choice"] is False
    assert (last["avoidable_tokens"], last["avoided_tokens"]) == (avoidable, 0)
    assert last["regret_tokens"] == avoidable
    assert last["router"] == "round-robin"
    by_worker = {c["worker"]: c for c in last["candidates"]}
    assert by_worker[holder]["usable_tokens"] == avoidable
    assert by_worker[chosen]["usable_tokens"] == 0
    assert {"in_flight", "queued_prefill_tokens", "estimated_ttft_s"} <= set(by_worker[chosen])
    # the first request, whose prefix no engine held, is in the log too: no regret
    assert log["decisions"][0]["regret_tokens"] == 0
    assert admin.get("/admin/decisions?limit=1").json()["decisions"] == [last]

    after = counters(gw.url)
    assert (
        after["quillcache_prefill_tokens_avoidable_total"]
        - (before["quillcache_prefill_tokens_avoidable_total"])
        == avoidable
    )
    assert (
        after["quillcache_prefill_tokens_avoided_total"]
        == (before["quillcache_prefill_tokens_avoided_total"])
    )
    assert (
        after["quillcache_decisions_kv_optimal_total"]
        == (before["quillcache_decisions_kv_optimal_total"])
    )
    assert before["quillcache_decisions_kv_optimal_total"] >= 1  # the first request


def test_the_decision_log_needs_the_admin_token(three: Stack) -> None:
    gw = three.gateway
    assert gw is not None
    bare = http_get(gw.url + "/admin/decisions")
    assert bare.status_code == 401 and "error" in bare.json()
    wrong = http_get(gw.url + "/admin/decisions", headers={"authorization": "Bearer wrong"})
    assert wrong.status_code in (401, 403) and "error" in wrong.json()
    bad = three.admin().get("/admin/decisions?limit=zero")
    assert bad.status_code == 400 and "limit" in bad.json()["error"]["message"]
