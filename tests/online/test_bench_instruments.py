"""The instruments of bench_online and the gateway's hit counter: a steady upstream
(engine-sim --fixed-latency-ms), a flood that can be stopped, and the cached_tokens the
gateway reads from answers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from hypothesis import given
from hypothesis import strategies as st

from quillcache.gateway.proxy import usage_cached_tokens
from tests.online.conftest import Stack
from tests.online.helpers import http_get, http_post, wait_for

# JSON values whose strings may themselves spell the key, quotes and all
_text = st.text() | st.sampled_from(['"cached_tokens": 7', "cached_tokens", '{"cached_tokens":1}'])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=12,
)


@given(
    extra=st.dictionaries(_text.filter(lambda k: k != "usage"), _json, max_size=4),
    cached=st.none() | st.integers(0, 2**40),
    indent=st.sampled_from([None, 1]),
)
def test_cached_tokens_byte_search_agrees_with_a_json_parse(
    extra: dict[str, Any], cached: int | None, indent: int | None
) -> None:
    doc: dict[str, Any] = dict(extra)
    if cached is not None:
        doc["usage"] = {"prompt_tokens": 3, "prompt_tokens_details": {"cached_tokens": cached}}
    raw = json.dumps(doc, indent=indent).encode()
    parsed = json.loads(raw).get("usage")
    expected = parsed["prompt_tokens_details"]["cached_tokens"] if parsed else None
    assert usage_cached_tokens(raw) == expected
    if indent is None:  # an SSE event is one line
        chunk = b'data: {"choices": []}\n\ndata: ' + raw + b"\n\n"
        assert usage_cached_tokens(chunk) == expected


def _stream_times(url: str, max_tokens: int) -> list[float]:
    """Seconds from the request to each content chunk of a streamed completion."""
    body = {"prompt": "steady " * 20, "max_tokens": max_tokens, "stream": True}
    start = time.perf_counter()
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            choices = json.loads(line[6:])["choices"] if line.startswith("data: {") else []
            if choices and choices[0]["text"]:
                times.append(time.perf_counter() - start)
    return times


def test_fixed_latency_engine_is_steady_under_concurrency(stack: Stack) -> None:
    engine = stack.engine(extra=["--fixed-latency-ms", "400,100"])
    gw = stack.start_gateway({"parity_check": False})
    for url in (engine.url, gw.url):
        # 16 at once: a modelled engine would batch and queue them; this one must not
        with ThreadPoolExecutor(16) as pool:
            runs = list(pool.map(lambda _, u=url: _stream_times(u, 4), range(16)))
        for times in runs:
            # lower bounds only: a busy client can read a chunk late, never early
            assert len(times) == 4
            assert 0.4 <= times[0] < 5, times  # TTFT x [1, 2) per prompt
            assert 0.7 <= times[-1] < 8, times  # + 3 ITL


def test_fixed_latency_needs_two_numbers() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quillcache", "engine-sim", "--fixed-latency-ms", "100"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "--fixed-latency-ms wants 'TTFT,ITL'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_flood_stops_on_delete(stack: Stack) -> None:
    engine = stack.engine()
    started = http_post(engine.url + "/debug/flood", json={"blocks_per_s": 20_000, "seconds": 600})
    assert started.status_code == 202
    wait_for(lambda: http_get(engine.url + "/debug/flood").json()["published_blocks"] > 0)
    stopped = httpx.delete(engine.url + "/debug/flood", timeout=30).json()
    assert stopped["stopped"] is True
    wait_for(lambda: http_get(engine.url + "/debug/flood").json()["running"] is False)
    state = http_get(engine.url + "/debug/flood").json()
    time.sleep(0.3)
    assert (
        http_get(engine.url + "/debug/flood").json()["published_blocks"]
        == state["published_blocks"]
    )
    # stopping again is harmless, and a new flood may start
    assert httpx.delete(engine.url + "/debug/flood", timeout=30).json()["stopped"] is False
    again = http_post(engine.url + "/debug/flood", json={"blocks_per_s": 1000, "seconds": 0.1})
    assert again.status_code == 202
