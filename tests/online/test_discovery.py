"""Where an engine publishes, from what it says about itself (vLLM and SGLang shapes)."""

from __future__ import annotations

import json
import uuid

import httpx

from quillcache.gateway.workers import (
    server_args_of,
    sources_from_kv_event_sources,
    sources_from_server_info,
)
from tests.online.conftest import Stack, metric
from tests.online.helpers import http_get, http_post, wait_for


def test_vllm_kv_event_sources() -> None:
    info = {
        "sources": [
            {
                "dp_rank": 0,
                "endpoint": "tcp://*:5557",
                "replay_endpoint": "tcp://*:5558",
                "topic": "kv",
                "engine_binds": True,
            },
            {"dp_rank": 1, "endpoint": "tcp://10.0.0.9:5558", "engine_binds": False},
        ]
    }
    a, b = sources_from_kv_event_sources(info, "10.0.0.9")
    assert (a.endpoint, a.replay_endpoint, a.topic, a.bind) == (
        "tcp://10.0.0.9:5557",
        "tcp://10.0.0.9:5558",
        "kv",
        False,
    )
    assert (b.dp_rank, b.endpoint, b.replay_endpoint, b.bind) == (
        1,
        "tcp://10.0.0.9:5558",
        None,
        True,
    )


def test_sglang_server_info() -> None:
    cfg = {
        "publisher": "zmq",
        "endpoint": "tcp://*:6000",
        "replay_endpoint": "tcp://*:7000",
        "topic": "t",
    }
    sources = sources_from_server_info(
        {"kv_events_config": json.dumps(cfg), "dp_size": 2}, "gpu-node"
    )
    assert [(s.dp_rank, s.endpoint, s.replay_endpoint, s.bind) for s in sources] == [
        (0, "tcp://gpu-node:6000", "tcp://gpu-node:7000", False),
        (1, "tcp://gpu-node:6001", "tcp://gpu-node:7001", False),
    ]
    # a loopback endpoint without `*`: the engine connects, we bind
    (only,) = sources_from_server_info(
        {"kv_events_config": {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:6000"}}, "h"
    )
    assert only.bind and only.endpoint == "tcp://127.0.0.1:6000"
    assert sources_from_server_info({"kv_events_config": "{not json"}, "h") == []
    assert sources_from_server_info({"kv_events_config": {"publisher": "null"}}, "h") == []
    assert sources_from_server_info({}, "h") == []
    # a prefill/decode deployment nests the server arguments per role
    args = {"kv_events_config": json.dumps(cfg), "page_size": 32}
    assert server_args_of({"decode": [{"page_size": 1}], "prefill": [args]}) == args
    assert server_args_of(args) is args and server_args_of({"x": 1}) == {"x": 1}


def test_an_sglang_engine_is_found_through_its_server_info(stack: Stack) -> None:
    """An engine with SGLang's surface (no /kv_event_sources; `kv_events_config` as a JSON
    string in /server_info; sglang: metric names): the gateway subscribes to the
    advertised socket, replays from the advertised replay socket, scrapes its load."""
    engine = stack.engine(extra=["--flavor", "sglang"])
    assert http_get(engine.url + "/kv_event_sources").status_code == 404
    info = http_get(engine.url + "/server_info").json()
    kv = json.loads(info["kv_events_config"])
    assert kv["endpoint"].startswith("tcp://*:") and info["page_size"] == 16
    assert http_get(engine.url + "/get_server_info").json() == info
    gw = stack.start_gateway({"event_quiet_tail_s": 0.5})
    admin = stack.admin()
    (worker,) = admin.get("/admin/workers").json()["workers"]
    (source,) = worker["kv_sources"]
    assert source["endpoint"] == engine.ready["kv_endpoint"] and not source["bind"]
    assert source["replay_endpoint"] == engine.ready["replay_endpoint"]
    assert worker["block_size"] == 16

    def blocks(prompt: str) -> int:
        matches = admin.post("/admin/lookup", json={"prompt": prompt}).json()["matches"]
        return max((m["blocks"] for m in matches), default=0)

    live = ("sglang-live-" + uuid.uuid4().hex + " context " * 20)[:64]
    assert http_post(gw.url + "/v1/completions", json={"prompt": live, "max_tokens": 1}).is_success
    wait_for(lambda: blocks(live) == 4, what="blocks from the discovered event socket")
    # lost live: only the discovered replay socket has them
    assert http_post(engine.url + "/debug/drop_events", json={"count": 100}).status_code == 200
    lost = ("sglang-lost-" + uuid.uuid4().hex + " context " * 20)[:64]
    assert http_post(gw.url + "/v1/completions", json={"prompt": lost, "max_tokens": 1}).is_success
    wait_for(lambda: blocks(lost) == 4, what="blocks replayed from the discovered replay socket")
    assert metric(http_get(gw.url + "/metrics").text, "quillcache_kv_event_replays_total") >= 1
    # load from SGLang's metric names: a request that bypasses the gateway shows up
    body = {"prompt": "a long answer", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        wait_for(
            lambda: (
                metric(http_get(gw.url + "/metrics").text, "quillcache_worker_engine_running") == 1
            ),
            what="the engine's sglang:num_running_reqs scraped",
        )
