"""An engine's KV capacity from vLLM's `cache_config_info` (every CacheConfig field is a
label, `num_gpu_blocks` among them): what the retention policy's turnover uses."""

from __future__ import annotations

import pytest

from quillcache.connectors.engine_metrics import parse_engine_metrics

PAGE = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="%s",'
    'prefix_caching_hash_algo="sha256_cbor"} 1.0\n'
)


@pytest.mark.parametrize(
    ("value", "blocks"), [("27000", 27000), ("None", None), ("0", None), ("-3", None)]
)
def test_num_gpu_blocks(value: str, blocks: int | None) -> None:
    load = parse_engine_metrics(PAGE % value)
    assert load.num_gpu_blocks == blocks
    assert load.block_size == 16


def test_no_cache_config_means_unknown() -> None:
    assert parse_engine_metrics("vllm:num_requests_running 1.0\n").num_gpu_blocks is None
