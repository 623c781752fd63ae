"""`engine-sim --engines N`: many simulated engines in one process, each as faithful as
a lone one (its own port, KV cache, /metrics, KV-event PUB and replay socket), and a
gateway in front of such a fleet. Real processes, sockets on 127.0.0.1, the official
`openai` client, real ZMQ."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import msgpack
import openai
import pytest
import zmq

from quillcache.connectors.replay import fetch_replay
from quillcache.up import Proc, launch
from tests.online.conftest import ADMIN, metric
from tests.online.helpers import wait_for

KV_WILDCARD = {
    "enable_kv_cache_events": True,
    "publisher": "zmq",
    "endpoint": "tcp://127.0.0.1:*",
    "replay_endpoint": "tcp://127.0.0.1:*",
}
PROMPT = "The fleet shares one process but never one cache. " * 8  # 25+ blocks of 16


def _fleet(workdir: Path, n: int, *extra: str, kv: dict[str, Any] | None = None) -> Proc:
    args = ["engine-sim", "--engines", str(n), "--time-scale", "0"]
    args += ["--kv-events-config", json.dumps(kv or KV_WILDCARD), *extra]
    if "--port" not in extra:
        args += ["--port", "0"]
    return launch(f"fleet{n}", args, workdir)


def _complete(url: str, prompt: str = PROMPT) -> Any:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    return client.completions.create(model="sim-model", prompt=prompt, max_tokens=2)


def _subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _stored_blocks(sub: zmq.Socket, wait_ms: int) -> int:
    """BlockStored hashes received on `sub` within `wait_ms` (after the first frame:
    until the socket is quiet)."""
    blocks = 0
    while sub.poll(wait_ms):
        _topic, seq, payload = sub.recv_multipart()
        assert len(seq) == 8
        _, events, _ = msgpack.unpackb(payload)
        for ev in events:
            kind = ev["type"] if isinstance(ev, dict) else ev[0]
            if kind == "BlockStored":
                blocks += len(ev["block_hashes"] if isinstance(ev, dict) else ev[1])
        wait_ms = 300
    return blocks


def test_each_engine_of_a_fleet_has_its_own_port_cache_metrics_and_events(
    tmp_path: Path,
) -> None:
    fleet = _fleet(tmp_path, 3)
    engines = fleet.ready["engines"]
    assert len(engines) == 3
    assert len({e["port"] for e in engines}) == 3
    assert len({e["kv_endpoint"] for e in engines}) == 3
    assert len({e["replay_endpoint"] for e in engines}) == 3
    assert fleet.url == engines[0]["url"]  # a lone engine's keys name engine 0
    ctx = zmq.Context()
    subs = [_subscribe(ctx, e["kv_endpoint"]) for e in engines]
    try:
        time.sleep(0.3)  # the subscriptions reach the PUBs (a slow joiner loses frames)
        # engine 1 computes the prompt, then hits it; engine 2 has never seen it
        first = _complete(engines[1]["url"])
        again = _complete(engines[1]["url"])
        other = _complete(engines[2]["url"])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        # each engine's events on its own socket only
        assert _stored_blocks(subs[1], 2000) > 0
        assert _stored_blocks(subs[2], 2000) > 0
        assert _stored_blocks(subs[0], 300) == 0
        # /metrics: each engine counts its own requests
        pages = [httpx.get(e["url"] + "/metrics").text for e in engines]
        queries = [metric(p, "vllm:prefix_cache_queries_total") for p in pages]
        hits = [metric(p, "vllm:prefix_cache_hits_total") for p in pages]
        prompt_tokens = first.usage.prompt_tokens
        assert queries == [0, 2 * prompt_tokens, prompt_tokens]
        assert hits[0] == hits[2] == 0 and hits[1] > 0
        # every replay socket answers (one replay thread serves the whole fleet)
        replays = [fetch_replay(ctx, e["replay_endpoint"], 0) for e in engines]
        assert [r.complete for r in replays] == [True, True, True]
        assert len(replays[0].batches) == 0
        assert len(replays[1].batches) > 0 and len(replays[2].batches) > 0
        # each engine its own /kv_event_sources
        for e in engines:
            src = httpx.get(e["url"] + "/kv_event_sources").json()["sources"]
            assert [s["endpoint"] for s in src] == [e["kv_endpoint"]]
    finally:
        for s in subs:
            s.close(0)
        ctx.term()
        fleet.kill()


def _free_range(n: int) -> int:
    """A base port with n consecutive free ports (checked by binding them)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + n > 65000:
            continue
        held = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    pytest.skip("no range of free ports found")


def test_fixed_ports_are_base_plus_engine_index(tmp_path: Path) -> None:
    n = 3
    base = _free_range(n)
    kv_base = _free_range(2 * n)
    kv = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{kv_base}",
        "replay_endpoint": f"tcp://*:{kv_base + n}",
    }
    fleet = _fleet(tmp_path, n, "--port", str(base), kv=kv)
    try:
        engines = fleet.ready["engines"]
        assert [e["port"] for e in engines] == [base, base + 1, base + 2]
        assert [e["kv_endpoint"].rsplit(":", 1)[1] for e in engines] == [
            str(kv_base + i) for i in range(n)
        ]
        assert [e["replay_endpoint"].rsplit(":", 1)[1] for e in engines] == [
            str(kv_base + n + i) for i in range(n)
        ]
        for e in engines:
            assert httpx.get(e["url"] + "/health").status_code == 200
    finally:
        fleet.kill()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engines", "0"], "--engines must be at least 1"),
        (["--engines", "-3"], "--engines must be at least 1"),
        (["--engines", "10", "--port", "65530"], "go past port 65535"),
        (["--engines", "2", "--data-parallel-size", "0"], "--data-parallel-size must be"),
        (
            [
                "--engines",
                "4",
                "--kv-events-config",
                '{"enable_kv_cache_events": true, "endpoint": "tcp://*:65534"}',
            ],
            "go past 65535",
        ),
    ],
)
def test_bad_fleet_values_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quillcache", "engine-sim", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_a_taken_port_names_the_engine(tmp_path: Path) -> None:
    base = _free_range(3)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", base + 2))
        taken.listen()
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "quillcache",
                "engine-sim",
                "--engines",
                "3",
                "--port",
                str(base),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 2
    assert f"engine 2: cannot listen on 127.0.0.1:{base + 2}" in out.stderr


def test_gateway_in_front_of_a_fleet_checks_scrapes_and_routes_each_engine(
    tmp_path: Path,
) -> None:
    fleet = _fleet(tmp_path, 4)
    engines = fleet.ready["engines"]
    cfg = tmp_path / "gw.json"
    cfg.write_text(
        json.dumps(
            {
                "admin_token": ADMIN,
                "tokenizer": "builtin",
                "router": "quillcache",
                "secret_file": str(tmp_path / "secret.json"),
                "workers": [{"url": e["url"]} for e in engines],
                "health_interval_s": 0.2,
                "scrape_interval_s": 0.2,
                "parity_check": False,  # its probe prompts would count in the engines' queries
            }
        )
    )
    gw = launch("gateway", ["gateway", "--port", "0", "--config", str(cfg)], tmp_path)
    admin = httpx.Client(base_url=gw.url, timeout=10, headers={"authorization": f"Bearer {ADMIN}"})
    try:

        def workers() -> list[dict[str, Any]]:
            return list(admin.get("/admin/workers").json()["workers"])

        wait_for(
            lambda: (
                all(w["healthy"] and w["kv_sources"] for w in workers()) and len(workers()) == 4
            ),
            what="4 healthy workers with their event sources",
        )
        # a prefix goes to its holder: the follow-up hits in that engine's cache
        first = _complete(gw.url)
        wait_for(
            lambda: (
                admin.post("/admin/lookup", json={"model": "sim-model", "prompt": PROMPT})
                .json()
                .get("matches")
            ),
            what="the prompt's blocks in the index",
        )
        again = _complete(gw.url)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens > 0

        # scraped: the engine that served them reports its queries
        def scraped_queries() -> float:
            return sum(w["load"]["prefix_queries"] for w in workers())

        wait_for(lambda: scraped_queries() == 2 * first.usage.prompt_tokens, what="scrapes")
        # health: one engine of the fleet turns unhealthy, then well again
        target = engines[2]["url"]
        httpx.post(target + "/debug/health", json={"healthy": False}).raise_for_status()
        wait_for(
            lambda: [w["healthy"] for w in workers() if w["url"] == target] == [False],
            what="engine 2 marked down",
        )
        assert sum(w["healthy"] for w in workers()) == 3
        httpx.post(target + "/debug/health", json={"healthy": True}).raise_for_status()
        wait_for(lambda: all(w["healthy"] for w in workers()), what="engine 2 back")
    finally:
        admin.close()
        gw.kill()
        fleet.kill()
