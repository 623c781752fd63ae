"""Hot-prefix replication end to end: engine simulators and the gateway as processes,
the official `openai` client.

Two engines of two sequence slots each, SGLang's cache-aware router (a request goes to
the engine with the longest match, on a tie the one with fewer requests in flight, and
only an in-flight imbalance of 64 moves it elsewhere): a burst of one tenant's requests
sharing a system prompt queues on the one engine holding it while the other idles. With
replication on, the policy engine copies the prompt onto the idle engine (a one-token
request with the tenant's salt) and later requests are served from cache there (the
engine's own `cached_tokens`); with it off, no request is. Another tenant's identical
prompt is another namespace: neither copy serves it.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from quillcache.gateway.tenancy import hash_key
from tests.online.conftest import Stack, make_stack, metric

WARMS = "quillcache_policy_warm_requests_total"
BLOCK = 16  # the engine simulator's block size; builtin tokenizer: a token per byte
KEYS = {"k-acme": "acme", "k-other": "other"}
SYSTEM_BLOCKS = 24


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


def text(tag: str, blocks: int) -> str:
    out = (f"{tag} " + "a popular system prompt that every request starts with " * blocks)[
        : blocks * BLOCK
    ]
    assert len(out.encode()) == blocks * BLOCK
    return out


SYSTEM = text("system", SYSTEM_BLOCKS)


def served_by(c: openai.OpenAI, prompt: str, max_tokens: int = 24) -> tuple[int, int]:
    raw = c.completions.with_raw_response.create(
        model="sim-model", prompt=prompt, max_tokens=max_tokens
    )
    usage = raw.parse().usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    return int(raw.headers["x-quillcache-worker"]), cached


def burst(stack: Stack, replication: bool) -> tuple[list[tuple[int, int]], str, openai.OpenAI, int]:
    """The served (worker, cached tokens) of a burst on one tenant's hot prefix, the
    gateway's metrics, another tenant's client, and the engine the prefix went to first
    (nothing matched: the sglang router's smaller cache, which the start-up parity probe
    may have changed, so either engine)."""
    for _ in range(2):
        stack.engine(extra=["--max-num-seqs", "2"])
    gw = stack.start_gateway(
        {
            "router": "sglang",
            "api_keys": [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items()],
            "policy": {
                "interval_s": 0.1,
                "replication": {
                    "enabled": replication,
                    "min_rate": 0.5,
                    "min_blocks": 4,
                    "cooldown_s": 0.5,
                },
            },
        }
    )
    acme = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=0)
    first, _ = served_by(acme, SYSTEM + " the first request", max_tokens=1)
    with ThreadPoolExecutor(16) as pool:
        out = list(
            pool.map(
                lambda i: served_by(acme, SYSTEM + f" request {i} " + text(f"q{i}", 8)),
                range(64),
            )
        )
    page = httpx.get(gw.url + "/metrics").text
    other = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-other", max_retries=0)
    return out, page, other, first


def test_a_hot_prefix_is_replicated_onto_the_idle_engine_for_its_tenant_only(
    stack: Stack,
) -> None:
    served, page, other, holder = burst(stack, replication=True)
    idle = 1 - holder
    # idempotent: the idle engine is the only other engine, and once the index shows it there
    # it is a holder, never a target again
    assert metric(page, WARMS + '{action="replicate",outcome="ok"}') == 1
    assert metric(page, 'quillcache_policy_decisions_total{action="replicate"}') >= 1
    assert metric(page, 'quillcache_policy_prefill_tokens_total{action="replicate"}') >= (
        SYSTEM_BLOCKS * BLOCK // 2
    )
    # the replica filled acme's namespace on the idle engine: acme's requests hit there
    on_replica = [cached for worker, cached in served if worker == idle]
    assert on_replica and max(on_replica) >= (SYSTEM_BLOCKS // 2) * BLOCK
    # the same prompt from another tenant is another namespace: no copy serves it
    _, cached = served_by(other, SYSTEM + " another tenant's request")
    assert cached == 0


def test_without_replication_the_hot_prefix_stays_on_its_one_engine(stack: Stack) -> None:
    served, page, _, holder = burst(stack, replication=False)
    assert metric(page, WARMS + '{action="replicate"') == 0
    assert all(cached < BLOCK * 4 for worker, cached in served if worker != holder)
    assert sum(worker == holder for worker, _ in served) >= len(served) * 0.9
