"""Where an engine publishes, from what it says about itself (vLLM and SGLang shapes)."""

from __future__ import annotations

import json

from quillcache.gateway.workers import sources_from_kv_event_sources, sources_from_server_info


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
