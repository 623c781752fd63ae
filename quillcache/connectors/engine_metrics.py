"""Reading an engine's Prometheus `/metrics` (vLLM's or SGLang's names) into load numbers."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens, cumulative
    prefix_hits: float = 0.0
    block_size: int | None = None


def parse_engine_metrics(text: str) -> EngineLoad:
    """Sum each metric over its label sets (one per engine core / model)."""
    load = EngineLoad()
    fields = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
        "vllm:gpu_cache_usage_perc": "kv_usage",  # before vLLM 0.10
        "vllm:prefix_cache_queries": "prefix_queries",
        "vllm:prefix_cache_hits": "prefix_hits",
        # SGLang (served with --enable-metrics)
        "sglang:num_running_reqs": "running",
        "sglang:num_queue_reqs": "waiting",
        "sglang:token_usage": "kv_usage",
    }
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            for sample in family.samples:
                bs = sample.labels.get("block_size")
                if bs and bs.isdigit():
                    load.block_size = int(bs)
            continue
        name = fields.get(family.name)
        if name is None:
            continue
        total = sum(s.value for s in family.samples if not s.name.endswith("_created"))
        if name == "kv_usage":
            n = sum(1 for s in family.samples)
            total = total / n if n else 0.0
        setattr(load, name, total)
    return load
