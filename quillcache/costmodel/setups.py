"""Named serving setups: a model on a GPU (or a tensor-parallel group of GPUs), each a
whole `CostModelConfig`. The simulator's matrix (`quillcache simulate --matrix`) names
them; every figure's source is in docs/simulator.md ("Setups").

Tensor parallelism is modelled as one engine whose compute, memory bandwidth, memory
and activation reserve are the group's sums: the weights and the KV heads are split
evenly over the GPUs and each GPU runs its share of every step. The all-reduces between
the GPUs are not modelled, so a TP setup is an upper bound on its speed.
"""

from __future__ import annotations

from dataclasses import dataclass

from quillcache.costmodel.config import CostModelConfig, EngineSpec, GpuSpec, ModelSpec
from quillcache.errors import ConfigError

A100_SXM4_80GB = GpuSpec()  # the cost model's default GPU

# NVIDIA H100 SXM5 80GB: 989.4 TFLOPS dense bf16, 1,978.9 dense FP8 (twice those with
# sparsity), 80 GB HBM3 at 3.35 TB/s. How well vLLM uses it is not published for these
# setups; the A100's fractions (docs/simulator.md) are kept as assumptions.
H100_SXM5_80GB = GpuSpec(name="H100-SXM5-80GB", peak_tflops=989.4, hbm_gbps=3350.0, memory_gb=80.0)

LLAMA_31_8B = ModelSpec()  # the cost model's default model

# meta-llama/Llama-3.1-70B-Instruct config.json: 80 layers, hidden 8192, 8 KV heads of
# 128; 70.6 B parameters (model card).
LLAMA_31_70B = ModelSpec(
    name="meta-llama/Llama-3.1-70B-Instruct",
    params_billion=70.6,
    layers=80,
    hidden_size=8192,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=2,
)

# Qwen/Qwen3-32B-FP8: Qwen3-32B's shape (config.json: 64 layers, hidden 5120, 64 query
# and 8 KV heads of 128; 32.8 B parameters, model card) with FP8 weights; vLLM's KV cache
# stays bf16 by default.
QWEN3_32B_FP8 = ModelSpec(
    name="Qwen/Qwen3-32B-FP8",
    params_billion=32.8,
    layers=64,
    hidden_size=5120,
    kv_heads=8,
    head_dim=128,
    dtype_bytes=1,
    kv_dtype_bytes=2,
)


def tensor_parallel(gpu: GpuSpec, size: int) -> GpuSpec:
    """`size` GPUs serving one engine, as one GPU with their summed compute, bandwidth
    and memory (the fractions of peak and the per-step overhead stay a single GPU's)."""
    if size < 1:
        raise ConfigError(f"tensor-parallel size must be >= 1, got {size}")
    if size == 1:
        return gpu
    return gpu.model_copy(
        update={
            "name": f"{size}x {gpu.name} (TP{size})",
            "peak_tflops": gpu.peak_tflops * size,
            "hbm_gbps": gpu.hbm_gbps * size,
            "memory_gb": gpu.memory_gb * size,
        }
    )


@dataclass(frozen=True)
class Setup:
    """One named setup: what it is, and its cost model."""

    name: str
    summary: str
    config: CostModelConfig


def _setups() -> dict[str, Setup]:
    engine = EngineSpec()
    tp4_engine = engine.model_copy(
        # vLLM profiles activation memory on every rank of the group
        update={"activation_reserve_gb": engine.activation_reserve_gb * 4}
    )
    fp8_h100 = H100_SXM5_80GB.model_copy(
        # W8A8 FP8 runs the linear layers (most of the prefill FLOPs below ~8k tokens)
        # on the FP8 tensor cores; attention stays bf16, so long prompts are optimistic
        update={"name": "H100-SXM5-80GB (FP8)", "peak_tflops": 1978.9}
    )
    table = [
        Setup(
            "llama-8b-a100",
            "Llama-3.1-8B bf16 on one A100-SXM4-80GB (the cost model's default)",
            CostModelConfig(),
        ),
        Setup(
            "llama-70b-tp4-h100",
            "Llama-3.1-70B bf16, tensor-parallel over 4 H100-SXM5-80GB",
            CostModelConfig(
                model=LLAMA_31_70B, gpu=tensor_parallel(H100_SXM5_80GB, 4), engine=tp4_engine
            ),
        ),
        Setup(
            "qwen3-32b-fp8-h100",
            "Qwen3-32B FP8 weights, bf16 KV, on one H100-SXM5-80GB",
            CostModelConfig(model=QWEN3_32B_FP8, gpu=fp8_h100),
        ),
    ]
    return {s.name: s for s in table}


SETUPS: dict[str, Setup] = _setups()


def setup(name: str) -> Setup:
    """The named setup, or a ConfigError listing the known ones."""
    try:
        return SETUPS[name]
    except KeyError:
        raise ConfigError(f"unknown setup {name!r}; known: {', '.join(SETUPS)}") from None
