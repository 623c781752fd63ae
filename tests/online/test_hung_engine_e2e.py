"""An engine that hangs (SIGSTOP: its sockets stay open, nothing answers) on both data
paths: before its first byte the request is retried on another engine; mid-stream the
client gets the SSE error event; either way the engine is marked down, within the
configured limits rather than the request timeout. A long prefill is not a hang."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from quillcache.up import Proc
from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import http_get

pytestmark = pytest.mark.slow  # real engine processes, stopped and resumed

FIRST_BYTE_S = 1.5
STALL_S = 1.5
HANG_LIMITS = {
    "router": "round-robin",
    "health_interval_s": 60,  # only the gateway's own timeouts can see the hang
    "first_byte_timeout_s": FIRST_BYTE_S,
    "first_byte_multiplier": 1.0,
    "stall_timeout_s": STALL_S,
}


@pytest.fixture(params=["native", "python"])
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path, relay=request.param)


def stop(engine: Proc) -> None:
    engine.popen.send_signal(signal.SIGSTOP)


def resume(engine: Proc) -> None:
    if engine.alive():
        engine.popen.send_signal(signal.SIGCONT)


def healthy(stack: Stack) -> dict[int, bool]:
    workers = stack.admin().get("/admin/workers").json()["workers"]
    return {w["id"]: w["healthy"] for w in workers}


@pytest.mark.parametrize("stream", [False, True])
def test_a_hung_engine_before_its_first_byte_is_retried_elsewhere(
    stack: Stack, stream: bool
) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(HANG_LIMITS)
    stop(stack.engines[0])
    try:
        waits = []
        for i in range(3):  # round-robin: one of the first two goes to the hung engine
            started = time.perf_counter()
            r = httpx.post(
                gw.url + "/v1/completions",
                json={"prompt": f"hung {i}", "max_tokens": 4, "stream": stream},
                timeout=30,
            )
            waits.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
            assert r.headers["x-quillcache-worker"] == "1"
            assert ("data: " in r.text) == stream
        # the one that met the hung engine waited for the first-byte limit, not 20 s+
        assert max(waits) < FIRST_BYTE_S + 2.0, waits
        assert max(waits) >= FIRST_BYTE_S * 0.9, waits
        text = http_get(gw.url + "/metrics").text
        assert metric(text, "quillcache_upstream_retries_total") == 1
        assert healthy(stack) == {0: False, 1: True}
    finally:
        resume(stack.engines[0])


def test_a_hung_engine_s_tokenize_is_asked_elsewhere(stack: Stack) -> None:
    """With the engines tokenizing, the first routable engine is asked for a text
    prompt's token ids. It hangs: after the first-byte limit it is marked down and the
    other engine tokenizes (was: every text request waited for the 600 s request
    timeout, a healthy engine beside it)."""
    stack.engine()
    stack.engine()
    gw = stack.start_gateway({**HANG_LIMITS, "tokenizer": "engine"})
    stop(stack.engines[0])
    try:
        waits = []
        for i in range(3):
            started = time.perf_counter()
            r = httpx.post(
                gw.url + "/v1/completions",
                json={"prompt": f"a text prompt {i}", "max_tokens": 4},
                timeout=30,
            )
            waits.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
            assert r.headers["x-quillcache-worker"] == "1"
        assert waits[0] < FIRST_BYTE_S + 2.0, waits
        assert max(waits[1:]) < 1.0, waits  # engine 0 is down: not asked again
        text = http_get(gw.url + "/metrics").text
        assert metric(text, "quillcache_upstream_retries_total") == 1  # the tokenize retry
        assert healthy(stack) == {0: False, 1: True}
    finally:
        resume(stack.engines[0])


def test_a_stream_whose_engine_hangs_mid_way_ends_with_an_error(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(HANG_LIMITS)
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
    raw = oa.completions.with_raw_response.create(
        model="sim-model", prompt="a long answer " * 8, max_tokens=1000, stream=True
    )
    victim = stack.engines[int(raw.headers["x-quillcache-worker"])]
    got = 0
    stopped_at = 0.0
    try:
        with pytest.raises(openai.APIError, match="mid-stream"):
            for _chunk in raw.parse():
                got += 1
                if got == 3:
                    stop(victim)
                    stopped_at = time.perf_counter()
        waited = time.perf_counter() - stopped_at
        assert got >= 3
        assert waited < STALL_S + 2.0, waited
        victim_id = int(raw.headers["x-quillcache-worker"])
        assert healthy(stack)[victim_id] is False
    finally:
        resume(victim)


def test_a_long_prefill_is_not_a_hang(stack: Stack) -> None:
    """The engine takes seconds to prefill a long prompt (a slow time scale), longer
    than the first-byte floor: the limit scales with the cost model's prefill estimate."""
    stack.engine(time_scale=8.0)
    gw = stack.start_gateway(
        {
            "router": "round-robin",
            "health_interval_s": 60,
            "first_byte_timeout_s": 1.0,
            "first_byte_multiplier": 20.0,
            "stall_timeout_s": STALL_S,
        }
    )
    document = "".join(f"line {i} of a long document. " for i in range(250))[:6000]
    for stream in (True, False):
        long_prompt = f"stream={stream}: {document}"  # nothing cached
        started = time.perf_counter()
        r = httpx.post(
            gw.url + "/v1/completions",
            json={"prompt": long_prompt, "max_tokens": 2, "stream": stream},
            timeout=60,
        )
        waited = time.perf_counter() - started
        assert r.status_code == 200, r.text
        assert waited > 1.5, f"the prefill must outlast the floor to prove anything: {waited}"
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_upstream_retries_total") == 0
    assert healthy(stack) == {0: True}


def test_a_whole_answer_failed_by_a_dying_engine_names_it(stack: Stack) -> None:
    """The engine is SIGKILLed while it computes a non-streamed answer (no head yet): the
    client gets its answer from the other engine (a retry) or a JSON 502, and either way
    the answer names the worker in `x-quillcache-worker`."""
    stack.engine(time_scale=10.0)  # a whole answer takes long enough to kill the engine
    stack.engine(time_scale=10.0)
    gw = stack.start_gateway({"router": "round-robin", "health_interval_s": 60})
    body = {"prompt": "a whole answer " * 8, "max_tokens": 16, "stream": False}
    with httpx.Client(timeout=60) as client:
        first = client.post(gw.url + "/v1/completions", json={**body, "max_tokens": 1})
        assert first.status_code == 200
        victim = 1 - int(first.headers["x-quillcache-worker"])  # round robin: next one

        import threading

        answer: list[httpx.Response] = []
        t = threading.Thread(
            target=lambda: answer.append(client.post(gw.url + "/v1/completions", json=body))
        )
        t.start()
        time.sleep(0.5)  # routed and computing
        stack.engines[victim].kill()
        t.join(60)
    r = answer[0]
    assert r.status_code in (200, 502), r.text
    assert "x-quillcache-worker" in r.headers, (r.status_code, dict(r.headers))
    if r.status_code == 502:
        assert r.headers["x-quillcache-worker"] == str(victim)
        assert r.json()["error"]["message"]
    else:
        assert r.headers["x-quillcache-worker"] == str(1 - victim)
