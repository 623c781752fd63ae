"""`quillcache up` and `quillcache loadgen` as a user runs them (real processes)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from quillcache.errors import ConfigError
from quillcache.loadgen.report import summarize
from quillcache.loadgen.runner import RunConfig, Sample, run_load
from quillcache.loadgen.workload import mooncake_trace, synthetic
from quillcache.serving import run_loop
from quillcache.up import launch
from tests.online.conftest import Stack, metric
from tests.online.helpers import http_post, wait_for

pytestmark = pytest.mark.slow  # whole CLIs as subprocesses


def test_loadgen_against_an_engine_and_through_the_gateway(stack: Stack) -> None:
    engine = stack.engine()
    gw = stack.start_gateway()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "quillcache",
            "loadgen",
            "--url",
            engine.url,
            "--url",
            gw.url,
            "--name",
            "direct",
            "--name",
            "gateway",
            "--requests",
            "40",
            "--concurrency",
            "8",
            "--max-tokens",
            "4",
            "--prefixes",
            "2",
            "--json",
            "-",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    for name in ("direct", "gateway"):
        r = results[name]
        assert r["requests"] == 40 and r["errors"] == 0
        assert 0 < r["ttft_ms_p50"] <= r["e2e_ms_p50"]
        assert r["itl_ms_p50"] is not None
    # two shared prefixes: most prompt tokens are engine cache hits after the first ones
    assert results["gateway"]["cache_hit_rate"] > 0.5
    assert results["gateway"]["workers"] == {"0": 40}
    chat = subprocess.run(
        [
            sys.executable,
            "-m",
            "quillcache",
            "loadgen",
            "--url",
            gw.url,
            "--chat",
            "--no-stream",
            "--requests",
            "10",
            "--concurrency",
            "4",
            "--rate",
            "50",
            "--json",
            "-",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert chat.returncode == 0, chat.stderr
    r = json.loads(chat.stdout)[gw.url]
    assert r["requests"] == 10 and r["errors"] == 0 and r["ttft_ms_p50"] == r["e2e_ms_p50"]


def test_warmup_requests_are_sent_in_the_same_session_but_not_measured(stack: Stack) -> None:
    engine = stack.engine(time_scale=0.0)
    reqs = synthetic(12, prefixes=2, prefix_chars=64, suffix_chars=8, max_tokens=2)

    def finished() -> float:
        return metric(httpx.get(engine.url + "/metrics").text, "vllm:request_success_total")

    before = finished()
    cfg = RunConfig(url=engine.url, concurrency=3, warmup=5)
    samples, wall = run_loop(run_load(cfg, reqs))
    assert len(samples) == 7 and all(s.ok for s in samples) and wall > 0
    assert finished() - before == 12  # the 5 warm-up requests did run


def test_the_floor_proxy_relays_streams_unchanged(stack: Stack) -> None:
    """bench_online's `--floor` side: a plain relay, so its answers are the engine's."""
    engine = stack.engine(time_scale=0.0)
    floor = launch(
        "floor",
        ["--upstream", engine.url],
        stack.workdir,
        module="benchmarks.online.floor_proxy",
    )
    stack.procs.append(floor)
    body = {"model": "sim-model", "prompt": "the same prompt", "max_tokens": 5, "stream": True}

    def chunks(url: str) -> list[str]:
        with httpx.stream("POST", url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            return [line for line in resp.iter_lines() if line.startswith("data: ")]

    direct, relayed = chunks(engine.url), chunks(floor.url)
    assert len(relayed) == len(direct) >= 6 and relayed[-1] == "data: [DONE]"
    text = [json.loads(c[6:])["choices"][0]["text"] for c in relayed[:-1]]
    assert text == [json.loads(c[6:])["choices"][0]["text"] for c in direct[:-1]]
    bad = httpx.post(floor.url + "/v1/completions", content=b"{not json")
    assert bad.status_code == 400  # the engine's own error, passed through


def test_loadgen_counts_errors() -> None:
    bad = [Sample(ok=False, error="HTTP 500: boom"), Sample(ok=True, ttft_s=0.1, e2e_s=0.2)]
    s = summarize(bad, 1.0)
    assert s["errors"] == 1 and s["error_kinds"] == {"HTTP 500": 1} and s["ok"] == 1
    assert s["error_examples"] == {"HTTP 500": "HTTP 500: boom"}  # why, not only how many


def test_mooncake_trace_prompts_share_text_where_ids_are_shared(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 20, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 1500, "input_length": 30, "output_length": 99, "hash_ids": [0, 1, 2]},
        {"timestamp": 3000, "input_length": 10, "output_length": 1, "hash_ids": [3]},
    ]
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    reqs = mooncake_trace(trace, block_chars=32, max_tokens=16, time_scale=0.5)
    assert reqs[1].prompt.startswith(reqs[0].prompt) and len(reqs[1].prompt) == 96
    assert not reqs[2].prompt.startswith(reqs[0].prompt[:32])
    assert [r.arrival_s for r in reqs] == [0.0, 0.75, 1.5]
    assert [r.max_tokens for r in reqs] == [5, 16, 1]
    trace.write_text('{"timestamp": 0}\n')
    with pytest.raises(ConfigError, match="not a Mooncake record"):
        mooncake_trace(trace)
    assert len({r.prompt for r in synthetic(50, prefixes=3)}) == 50


def test_up_starts_engines_and_a_gateway_and_stops_them(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "quillcache", "up", "--engines", "2", "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        gateway = None
        deadline = time.monotonic() + 40
        assert proc.stdout is not None
        while time.monotonic() < deadline and gateway is None:
            line = proc.stdout.readline()
            if line.startswith("gateway:"):
                gateway = line.split()[1]
        assert gateway, "up did not print the gateway address"
        r = http_post(gateway + "/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["text"]
        assert len(list(tmp_path.glob("*.ready.json"))) == 3  # 2 engines + the gateway
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    # the children went with it: nothing answers any more
    import httpx

    def all_down() -> bool:
        for ready in tmp_path.glob("*.ready.json"):
            try:
                httpx.get(json.loads(ready.read_text())["url"] + "/health", timeout=1)
                return False
            except httpx.HTTPError:
                continue
        return True

    wait_for(all_down, timeout=10, what="the engines and gateway to stop")
