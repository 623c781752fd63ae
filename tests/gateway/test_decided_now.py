"""The native relay decides a request in the read callback that received it
(`OpenAIEndpoints.prepare_now`) whenever the gateway tokenizes locally, with the same
result as the awaited path (`prepare`): with hot-prefix replication on or a session
retention hint, too, since both keep the prompt's tokens until the request is routed.
Gateways here run in-process with no engine (the builtin tokenizer, a block size
given): preparing a request needs none."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from starlette.datastructures import Headers

from quillcache.gateway.app import Gateway
from quillcache.gateway.config import GatewayConfig
from quillcache.gateway.httpio import ApiError
from quillcache.gateway.openai_api import Prepared

PROMPT = "a system prompt every request of the session starts with " * 4


def both_paths(policy: dict[str, Any], headers: dict[str, str]) -> tuple[Prepared | None, Prepared]:
    """`prepare_now` and `prepare` of one completion request on one gateway."""

    async def run() -> tuple[Prepared | None, Prepared]:
        gw = Gateway(
            GatewayConfig.model_validate(
                {"workers": [], "tokenizer": "builtin", "block_size": 16, "policy": policy}
            )
        )
        await gw.startup()
        try:
            body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 1}).encode()
            now = gw.openai.prepare_now(Headers(headers), body, False, "")
            later = await gw.openai.prepare(Headers(headers), body, False, "")
            return now, later
        finally:
            await gw.shutdown()

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize(
    ("policy", "headers", "kept"),
    [
        ({}, {}, False),
        ({"replication": {"enabled": True}}, {}, True),
        ({}, {"x-session-id": "s-1", "x-session-ttl-s": "30"}, True),
    ],
    ids=["plain", "replication", "session-hint"],
)
def test_the_relay_decides_now_as_the_awaited_path_does(
    policy: dict[str, Any], headers: dict[str, str], kept: bool
) -> None:
    now, later = both_paths(policy, headers)
    assert now is not None, "the relay would decide in a task: one more event-loop turn"
    assert now.raw == later.raw
    assert now.prompt_tokens == later.prompt_tokens == len(PROMPT.encode())
    assert now.route_request.content_keys.tolist() == later.route_request.content_keys.tolist()
    assert now.tokens == later.tokens
    assert now.retention == later.retention
    assert now.identity == later.identity
    assert now.model == later.model
    # what the policy engine keeps once the request is routed: its tokens, and whose
    assert (now.tokens is not None) == kept
    if kept:
        assert now.model == "m" and now.identity is not None


def refusal(now: bool, **fields: Any) -> ApiError:
    """The ApiError that `prepare_now` (`now`) or `prepare` raises for a completion
    request with these body `fields` on a gateway with the default SLO admission."""

    async def run() -> ApiError:
        gw = Gateway(
            GatewayConfig.model_validate({"workers": [], "tokenizer": "builtin", "block_size": 16})
        )
        await gw.startup()
        try:
            body = json.dumps({"model": "m", "prompt": PROMPT, "max_tokens": 1, **fields}).encode()
            try:
                if now:
                    gw.openai.prepare_now(Headers({}), body, False, "")
                else:
                    await gw.openai.prepare(Headers({}), body, False, "")
            except ApiError as exc:
                return exc
            raise AssertionError(f"{fields} was not refused")
        finally:
            await gw.shutdown()

    return asyncio.run(asyncio.wait_for(run(), 30))


@pytest.mark.parametrize("now", [True, False], ids=["prepare_now", "prepare"])
@pytest.mark.parametrize("priority", ["high", 1.5, True, 2**31])
def test_a_bad_priority_is_refused_without_a_queue_too(now: bool, priority: object) -> None:
    """With the default `slo_admission: reject` (no queue) the priority orders nothing
    here, but it goes to the engine: one that is not a 32-bit integer is a 400 naming
    the field, whichever path decides."""
    refused = refusal(now, priority=priority)
    assert refused.status == 400 and refused.param == "priority"
