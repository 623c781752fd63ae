"""The engine simulator refuses what vLLM's OpenAI server refuses, with a 400 in
OpenAI's error shape: requests the simulator would otherwise answer wrongly (`n` > 1
answered with one choice), or crash on (a prompt with a lone surrogate: a 500)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.online.conftest import make_stack

CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    for stack in make_stack(Path(tmp_path_factory.mktemp("engine"))):
        yield stack.engine().url


@pytest.mark.parametrize(
    ("path", "body", "said"),
    [
        ("/v1/completions", {"prompt": "hi", "n": 3}, "n"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, "role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "content"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_requests_vllm_refuses_are_a_400(
    engine_url: str, path: str, body: dict[str, object], said: str
) -> None:
    r = httpx.post(engine_url + path, json=body, timeout=10)
    assert r.status_code == 400, r.text
    assert said in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/completions"])
def test_a_lone_surrogate_is_a_400_not_a_500(engine_url: str, path: str) -> None:
    raw = b'{"prompt": "a \\ud800 b", "max_tokens": 1}'
    r = httpx.post(
        engine_url + path, content=raw, headers={"content-type": "application/json"}, timeout=10
    )
    assert r.status_code == 400, r.text
    assert "cannot tokenize the prompt" in r.json()["error"]["message"]


def test_what_vllm_takes_is_served(engine_url: str) -> None:
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "n": 1, "temperature": 0, "max_tokens": 1}),
        ("/v1/chat/completions", {**CHAT, "top_p": 0.9, "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": None}]}),
    ):
        r = httpx.post(engine_url + path, json=body, timeout=10)
        assert r.status_code == 200, (path, r.text)
