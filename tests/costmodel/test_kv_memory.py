"""The KV memory a capacity implies, and the warning when no GPU of the model holds it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig

GIB = 2**30
# Llama-3.1-8B bf16: K and V x 32 layers x 8 KV heads x 128 dims x 2 bytes
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
WEIGHT_BYTES = 8.03e9 * 2


def test_the_issue_example_is_625_gib_and_warned() -> None:
    cost = CostModel()
    assert cost.kv_gib(10_000, 512) == pytest.approx(10_000 * 512 * KV_BYTES_PER_TOKEN / GIB)
    assert cost.kv_gib(10_000, 512) == pytest.approx(625.0)
    line = cost.kv_memory_warning(10_000, 512)
    assert line is not None and "\n" not in line
    assert "625.0 GiB" in line and "A100-SXM4-80GB" in line and "65.0 GiB" in line


def test_the_default_capacity_fits_without_a_warning() -> None:
    cost = CostModel()
    for bs in (16, 64, 512):
        blocks = cost.kv_capacity_blocks(bs)
        assert cost.kv_memory_warning(blocks, bs) is None
        assert 0 < cost.kv_gib(blocks, bs) < cost.kv_gib_limit()


@given(
    bs=st.sampled_from([1, 16, 64, 512]),
    memory_gb=st.floats(24, 192),
    dtype_bytes=st.sampled_from([1, 2]),
)
def test_the_warning_starts_one_block_past_memory_less_weights(
    bs: int, memory_gb: float, dtype_bytes: int
) -> None:
    cfg = CostModelConfig().with_overrides(
        {"gpu.memory_gb": memory_gb, "model.dtype_bytes": dtype_bytes}
    )
    cost = CostModel(cfg)
    kv_per_token = 2 * 32 * 8 * 128 * dtype_bytes
    free = memory_gb * GIB - 8.03e9 * dtype_bytes
    most = int(free // (bs * kv_per_token))  # the most whole blocks that fit
    assert cost.kv_gib_limit() == pytest.approx(free / GIB)
    assert cost.kv_memory_warning(most, bs) is None
    assert cost.kv_memory_warning(most + 1, bs) is not None
