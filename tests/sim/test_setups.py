"""The matrix's named setups (quillcache.costmodel.setups): shapes from their configs,
tensor parallelism as the group's sums, FP8 weights with a bf16 KV cache."""

from __future__ import annotations

import pytest

from quillcache.costmodel import CostModel, ModelSpec
from quillcache.costmodel.setups import H100_SXM5_80GB, SETUPS, setup, tensor_parallel
from quillcache.errors import ConfigError


def test_kv_width_defaults_to_the_weights_and_can_differ() -> None:
    bf16 = ModelSpec()
    assert bf16.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    fp8_all = ModelSpec(dtype_bytes=1)
    assert fp8_all.kv_bytes_per_token == bf16.kv_bytes_per_token // 2
    fp8_weights = ModelSpec(dtype_bytes=1, kv_dtype_bytes=2)
    assert fp8_weights.kv_bytes_per_token == bf16.kv_bytes_per_token
    assert fp8_weights.weight_bytes == bf16.weight_bytes / 2


def test_tensor_parallel_sums_the_group() -> None:
    tp4 = tensor_parallel(H100_SXM5_80GB, 4)
    assert tp4.peak_tflops == pytest.approx(4 * 989.4)
    assert tp4.hbm_gbps == pytest.approx(4 * 3350.0)
    assert tp4.memory_gb == pytest.approx(320.0)
    assert (tp4.prefill_mfu, tp4.decode_mbu) == (H100_SXM5_80GB.prefill_mfu, 0.77)
    assert tensor_parallel(H100_SXM5_80GB, 1) is H100_SXM5_80GB
    with pytest.raises(ConfigError):
        tensor_parallel(H100_SXM5_80GB, 0)


@pytest.mark.parametrize(
    ("name", "kv_per_token", "weights_gb"),
    [
        ("llama-8b-a100", 2 * 32 * 8 * 128 * 2, 8.03 * 2),
        ("llama-70b-tp4-h100", 2 * 80 * 8 * 128 * 2, 70.6 * 2),
        ("qwen3-32b-fp8-h100", 2 * 64 * 8 * 128 * 2, 32.8 * 1),
    ],
)
def test_setups_hold_their_model(name: str, kv_per_token: int, weights_gb: float) -> None:
    s = setup(name)
    cost = CostModel(s.config)
    assert s.config.model.kv_bytes_per_token == kv_per_token
    assert s.config.model.weight_bytes == pytest.approx(weights_gb * 1e9)
    # the default capacity is what the GPU(s) hold beside the weights
    blocks = cost.kv_capacity_blocks(512)
    assert blocks > 0
    assert cost.kv_memory_warning(blocks, 512) is None
    assert cost.kv_memory_warning(blocks * 2, 512) is not None


def test_unknown_setup_names_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="unknown setup 'h200'; known: " + ", ".join(SETUPS)):
        setup("h200")
