"""Counters of the booking step and of the KV-cache group folder in a real gateway's
/metrics (docs/gateway.md, "Metrics"): engine simulators, a `redis-server` and the
gateway as processes on 127.0.0.1, requests through the official `openai` client."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import http_get, wait_for
from tests.state.server import RedisServer

BS = 16
BAD_ROUTER = "tests.gateway.bad_shortlist_router:NotLedByItsDecision"
FOLD = (
    "quillcache_kv_grouped_sources_total",
    "quillcache_kv_group_folded_batches_total",
)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer("redis-server", tmp_path).start()
    try:
        yield server
    finally:
        server.stop()


def prompt(tag: str, blocks: int = 4) -> str:
    """`blocks` full blocks of the builtin tokenizer (one token per byte)."""
    text = (f"[{tag}] " + "what the gateway counts, it exports " * 40)[: blocks * BS]
    assert len(text.encode()) == blocks * BS
    return text


def scrape(url: str) -> str:
    answer = http_get(url + "/metrics")
    assert answer.is_success, answer.text
    return answer.text


def complete(url: str, text: str) -> None:
    oa = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30.0)
    out = oa.completions.create(model="sim-model", prompt=text, max_tokens=2)
    assert out.choices


def test_router_shortlists_replaced_are_counted_in_metrics(
    stack: Stack, redis: RedisServer
) -> None:
    """A router whose shortlist is not led by its decision: every request is still
    answered (booked with the derived shortlist), and
    quillcache_state_bad_shortlists_total counts each one; a router that gives none
    (the default) leaves it at 0."""
    for _ in range(2):
        stack.engine(time_scale=0)
    fleet = {"state": redis.url, "state_prefix": f"t{uuid.uuid4().hex[:8]}", "state_budget_s": 0.25}
    good = stack.start_gateway({"router": "least-loaded", **fleet})
    bad = stack.start_gateway({"router": BAD_ROUTER, **fleet})
    for gw in (good, bad):
        assert "quillcache_state_bad_shortlists_total 0.0" in scrape(gw.url)
    for i in range(3):
        complete(bad.url, prompt(f"bad-{i}"))
        complete(good.url, prompt(f"good-{i}"))
    assert metric(scrape(bad.url), "quillcache_state_bad_shortlists_total") == 3
    assert metric(scrape(good.url), "quillcache_state_bad_shortlists_total") == 0
    assert metric(scrape(bad.url), "quillcache_state_bookings_total") == 3
    # cold engines and prefixes of their own: each booking took the first candidate
    # under its ceiling
    for gw in (good, bad):
        assert metric(scrape(gw.url), 'quillcache_state_booking_steps_total{step="under"}') == 3
    assert "gave a shortlist the booking cannot use" in bad.log_path.read_text()


def test_the_group_folders_counters_move_in_metrics(stack: Stack) -> None:
    """Beside a single-group engine, an engine publishing two KV-cache groups
    (`engine-sim --kv-groups 2`): one source is counted as grouped, and each request it
    serves adds folded batches; nothing is refused."""
    stack.engine(extra=["--block-size", str(BS), "--kv-groups", "2"], time_scale=0)
    stack.engine(extra=["--block-size", str(BS)], time_scale=0)
    gw = stack.start_gateway({"router": "round-robin", "event_quiet_tail_s": 0.5})
    wait_for(
        lambda: metric(scrape(gw.url), "quillcache_kv_grouped_sources_total") == 1,
        what="the grouped source counted (the start-up probe's events)",
    )
    folded = metric(scrape(gw.url), "quillcache_kv_group_folded_batches_total")
    for i in range(4):  # round-robin: two reach the grouped engine
        complete(gw.url, prompt(f"grouped-{i}-" + uuid.uuid4().hex[:8]))
    wait_for(
        lambda: metric(scrape(gw.url), "quillcache_kv_group_folded_batches_total") >= folded + 2,
        what="the grouped engine's new batches counted as folded",
    )
    after = scrape(gw.url)
    assert metric(after, "quillcache_kv_grouped_sources_total") == 1
    assert metric(after, "quillcache_kv_group_refused_batches_total") == 0
    assert "quillcache_kv_group_unplaced_blocks_total 0.0" in after
