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

import httpx
import openai
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


@pytest.fixture(params=["native", "python"])
def one_engine(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    for s in make_stack(tmp_path, request.param):
        s.engine()
        s.start_gateway({"router": "quillcache"})
        yield s


def _logged(
    oa: openai.OpenAI, admin: httpx.Client, tag: str, headers: dict[str, str]
) -> dict[str, object]:
    """Send one completion with `headers`; its sampled decision."""
    time.sleep(0.1)  # the log samples at most one decision per 50 ms
    before = len(admin.get("/admin/decisions").json()["decisions"])
    oa.completions.create(
        model="sim-model", prompt=prompt(6) + tag, max_tokens=2, extra_headers=headers
    )
    entries = admin.get("/admin/decisions").json()["decisions"]
    assert len(entries) == before + 1
    out: dict[str, object] = entries[-1]
    return out


def test_a_parent_hint_names_the_request_it_follows_in_the_log(one_engine: Stack) -> None:
    """`x-request-id` and `x-parent-request-id` through both data paths and the official
    client: the decision of a request naming an earlier one as its parent carries that
    request's gateway id (`Request.parent_id`, which `quillcache` routes by); a parent
    the gateway never saw gives no hint; an over-long id is a 400 naming the header."""
    gw = one_engine.gateway
    assert gw is not None
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    admin = one_engine.admin()
    planner = _logged(oa, admin, "plan", {"x-request-id": "task-7/plan"})
    assert planner["parent_request_id"] is None
    call = _logged(
        oa, admin, "call", {"x-request-id": "task-7/call-1", "x-parent-request-id": "task-7/plan"}
    )
    assert call["parent_request_id"] == planner["request_id"]
    grandchild = _logged(oa, admin, "join", {"x-parent-request-id": "task-7/call-1"})
    assert grandchild["parent_request_id"] == call["request_id"]
    stranger = _logged(oa, admin, "lost", {"x-parent-request-id": "never-sent"})
    assert stranger["parent_request_id"] is None
    with pytest.raises(openai.BadRequestError) as bad:
        oa.completions.create(
            model="sim-model",
            prompt="x",
            max_tokens=1,
            extra_headers={"x-parent-request-id": "p" * 257},
        )
    assert "x-parent-request-id" in str(bad.value) and "256" in str(bad.value)
