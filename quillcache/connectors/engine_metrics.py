"""Reading an engine's Prometheus `/metrics` (vLLM's or SGLang's names) into load numbers."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

#: The label that names a data-parallel rank's engine core (vLLM V1: `engine`).
RANK_LABEL = "engine"


@dataclass
class RankLoad:
    """One data-parallel rank's gauges (its samples summed; KV usage: their mean)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass
class EngineLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    prefix_queries: float = 0.0  # tokens, cumulative
    prefix_hits: float = 0.0
    block_size: int | None = None
    # KV blocks per engine core (vLLM's `cache_config_info` label `num_gpu_blocks`)
    num_gpu_blocks: int | None = None
    # per rank, from the samples labelled with a rank (`RANK_LABEL`); empty when none is
    ranks: dict[int, RankLoad] = field(default_factory=dict)


#: The per-rank gauges (`RankLoad`'s fields).
RANK_FIELDS = ("running", "waiting", "kv_usage")


def set_rank_values(load: EngineLoad, name: str, values: dict[int, list[float]]) -> None:
    """A gauge's samples by rank into `load.ranks` (a later family of the same field
    replaces an earlier one, as for the totals)."""
    for rank, samples in values.items():
        total = sum(samples)
        value = total / len(samples) if name == "kv_usage" else total
        setattr(load.ranks.setdefault(rank, RankLoad()), name, value)


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
                blocks = sample.labels.get("num_gpu_blocks")
                if blocks and blocks.isdigit() and int(blocks) > 0:
                    load.num_gpu_blocks = int(blocks)
            continue
        name = fields.get(family.name)
        if name is None:
            continue
        if name in RANK_FIELDS:
            by_rank: dict[int, list[float]] = {}
            for sample in family.samples:
                rank = sample.labels.get(RANK_LABEL, "")
                if rank.isdigit():
                    by_rank.setdefault(int(rank), []).append(sample.value)
            set_rank_values(load, name, by_rank)
        total = sum(s.value for s in family.samples if not s.name.endswith("_created"))
        if name == "kv_usage":
            n = sum(1 for s in family.samples)
            total = total / n if n else 0.0
        setattr(load, name, total)
    return load
