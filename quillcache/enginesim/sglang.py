"""The engine simulator dressed as an SGLang server (`engine-sim --flavor sglang`).

What differs from vLLM for a gateway: no `/kv_event_sources`; the KV-event publisher
is described by the server arguments that `GET /server_info` (and the older
`GET /get_server_info`) return, where `kv_events_config` is the JSON *string* given to
`--kv-events-config` and `dp_size` the number of attention-DP ranks (rank r publishes
on the configured port + r); the block size is `page_size`; `/metrics` uses SGLang's
names (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:cache_hit_rate`). KV events and the replay socket are the same wire format
(SGLang's replay answers in the topic layout), so the publisher is shared.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from quillcache.enginesim.engine import EngineConfig, SimEngine
from quillcache.enginesim.publisher import KvEventPublisher


def _as_configured(endpoint: str, binds: bool) -> str:
    """How an operator would have written a resolved endpoint: a bound one with the
    wildcard host (`tcp://*:5557`), so that a peer substitutes the engine's host."""
    if not binds or not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    return f"tcp://*:{port}"


def server_info(
    config: EngineConfig, publishers: Sequence[KvEventPublisher | None], version: str
) -> dict[str, Any]:
    """The subset of SGLang's server arguments a gateway reads, in SGLang's shape."""
    info: dict[str, Any] = {
        "model_path": config.model,
        "served_model_name": config.model,
        "page_size": config.block_size,
        "dp_size": len(publishers),
        "enable_dp_attention": len(publishers) > 1,
        "context_length": config.max_model_len,
        "max_running_requests": config.max_num_seqs,
        "kv_events_config": None,
        "version": version,
    }
    first = publishers[0] if publishers else None
    if first is not None:
        kv = {
            "publisher": "zmq",
            "endpoint": _as_configured(first.endpoint, first.binds),
            "topic": first.topic.decode(),
        }
        if first.replay_endpoint:
            kv["replay_endpoint"] = _as_configured(first.replay_endpoint, True)
        info["kv_events_config"] = json.dumps(kv)  # SGLang keeps the flag's string
    return info


class SglangCollector:
    """The engine's state under SGLang's metric names (one `engine` label per rank)."""

    def __init__(self, ranks: list[SimEngine]) -> None:
        self.ranks = ranks

    def collect(self) -> Iterator[Any]:
        labels = ["model_name", "engine"]

        def gauge(name: str, doc: str, value: Any) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for r in self.ranks:
                g.add_metric([r.config.model, str(r.dp_rank)], float(value(r)))
            return g

        yield gauge("sglang:num_running_reqs", "Running requests.", lambda r: r.running)
        yield gauge("sglang:num_queue_reqs", "Queued requests.", lambda r: r.waiting)
        yield gauge("sglang:token_usage", "KV-cache token usage (0..1).", lambda r: r.kv_usage)
        yield gauge(
            "sglang:cache_hit_rate",
            "Prefix-cache hit rate over all prompt tokens.",
            lambda r: r.prefix_hits / r.prefix_queries if r.prefix_queries else 0.0,
        )
