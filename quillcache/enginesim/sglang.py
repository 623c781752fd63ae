"""The engine simulator dressed as an SGLang server (`engine-sim --flavor sglang`).

What differs from vLLM for a gateway: no `/kv_event_sources`; the KV-event publisher
is described by the server arguments that `GET /server_info` (and the older
`GET /get_server_info`) return, where `kv_events_config` is the JSON *string* given to
`--kv-events-config` and `dp_size` the number of attention-DP ranks (rank r publishes
on the configured port + r); the block size is `page_size`; `/metrics` uses SGLang's
names (`sglang:num_running_reqs`, `sglang:num_queue_reqs`, `sglang:token_usage`,
`sglang:cache_hit_rate`). The KV events are in the format of the SGLang release given
to `--sglang-version` (`sglang_batch`, `quillcache.events.sglang`): tagged arrays up to
0.5.19, tagged maps from 0.5.20, signed 64-bit hashes, SGLang's medium names, the salt
and LoRA name as fields; the replay socket answers without the topic frame before
0.5.22 (`replay_layout`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client.core import GaugeMetricFamily

from quillcache import _native
from quillcache.events import sglang as sgl
from quillcache.events.types import AllBlocksCleared, BlockRemoved, BlockStored, Event

if TYPE_CHECKING:
    from quillcache.enginesim.engine import EngineConfig, SimEngine
    from quillcache.enginesim.publisher import KvEventPublisher

#: The release `--flavor sglang` simulates unless `--sglang-version` says otherwise.
DEFAULT_RELEASE = "0.5.23"
#: `--sglang-version` names for the two sides of the event-format boundary: the last
#: release with tagged-array events, and the default (tagged maps, replay with topic).
RELEASE_ALIASES = {"legacy": sgl.LAST_ARRAY_RELEASE, "current": DEFAULT_RELEASE}


def replay_layout(release: str) -> dict[str, bool]:
    """`KvEventPublisher` arguments for the replay replies of SGLang `release`: before
    0.5.22, `[b"", seq, payload]` and the end marker `[b"", END_SEQ, b""]`."""
    topic = sgl.wire_of(release).replay_topic
    return {"legacy_replay": not topic, "end_marker_topic": topic}


def sglang_batch(
    payload: bytes, wire: sgl.SglangWire, tags: Mapping[int, tuple[str, str, bool]]
) -> bytes:
    """One batch of the engine model (vLLM's format, u64 hashes, vLLM's medium names)
    in SGLang's format: signed hashes, `CPU_PINNED` for the CPU tier, and, for blocks of
    a LoRA / salted request (`tags`: engine hash -> (LoRA, salt, is block 0)), the
    event's `lora_name` and `cache_salt` fields instead of vLLM's extra keys."""
    batch = _native.decode_batch(payload)
    out: list[Event] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            tagged = [t for t in (tags.get(int(h)) for h in ev.block_hashes) if t]
            lora, salt = (tagged[0][0], tagged[0][1]) if tagged else ("", "")
            out.append(
                BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    lora_id=ev.lora_id,
                    medium=sgl.sglang_medium(ev.medium),
                    lora_name=lora or None,
                    cache_salt=salt or None,
                )
            )
        elif isinstance(ev, BlockRemoved):
            out.append(
                BlockRemoved(block_hashes=ev.block_hashes, medium=sgl.sglang_medium(ev.medium))
            )
        else:
            out.append(AllBlocksCleared())
    return sgl.encode_batch(out, batch.ts, batch.dp_rank, wire)


def _as_configured(endpoint: str, binds: bool) -> str:
    """How an operator would have written a resolved endpoint: a bound one with the
    wildcard host (`tcp://*:5557`), so that a peer substitutes the engine's host."""
    if not binds or not endpoint.startswith("tcp://"):
        return endpoint
    _, _, port = endpoint.rpartition(":")
    return f"tcp://*:{port}"


def server_info(
    config: EngineConfig, publishers: Sequence[KvEventPublisher | None]
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
        "version": config.sglang_release or DEFAULT_RELEASE,  # SGLang's own version
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
