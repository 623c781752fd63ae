"""The cost model's parameters: one pydantic model, loadable from JSON/YAML or flags.

Defaults describe Llama-3.1-8B (bf16) served by vLLM on one NVIDIA A100-SXM4-80GB.
Where each number comes from (datasheet, model config, or an assumption) is listed in
`docs/simulator.md`; every field can be overridden.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from quillcache.errors import ConfigError


class ModelSpec(BaseModel):
    """The served model's shape (from its `config.json`)."""

    model_config = ConfigDict(extra="forbid")

    name: str = "meta-llama/Llama-3.1-8B-Instruct"
    params_billion: float = Field(8.03, gt=0)
    layers: int = Field(32, gt=0)
    hidden_size: int = Field(4096, gt=0)
    kv_heads: int = Field(8, gt=0)
    head_dim: int = Field(128, gt=0)
    dtype_bytes: int = Field(2, gt=0)
    # An FP8-weight checkpoint keeps a bf16 KV cache unless vLLM is told otherwise
    # (--kv-cache-dtype), so the two widths are separate; None: as the weights.
    kv_dtype_bytes: int | None = Field(None, gt=0)

    @property
    def weight_bytes(self) -> float:
        return self.params_billion * 1e9 * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        width = self.kv_dtype_bytes or self.dtype_bytes
        return 2 * self.layers * self.kv_heads * self.head_dim * width


class GpuSpec(BaseModel):
    """The accelerator and how well vLLM uses it."""

    model_config = ConfigDict(extra="forbid")

    name: str = "A100-SXM4-80GB"
    peak_tflops: float = Field(312.0, gt=0)  # dense bf16
    hbm_gbps: float = Field(2039.0, gt=0)
    memory_gb: float = Field(80.0, gt=0)
    # Fractions of peak that vLLM reaches (decode_mbu from a published measurement;
    # prefill_mfu and the per-step overhead are assumptions): each against its source
    # in docs/simulator.md's cost-model table.
    prefill_mfu: float = Field(0.55, gt=0, le=1)
    decode_mbu: float = Field(0.77, gt=0, le=1)
    step_overhead_s: float = Field(0.001, ge=0)  # scheduler + sampling + launch per step


class EngineSpec(BaseModel):
    """vLLM engine settings that shape timing and capacity."""

    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(16, gt=0)
    max_num_batched_tokens: int = Field(8192, gt=0)  # chunked-prefill token budget per step
    max_num_seqs: int = Field(256, gt=0)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    activation_reserve_gb: float = Field(4.0, ge=0)  # vLLM's profiled peak activation memory
    kv_capacity_blocks: int | None = Field(None, gt=0)  # None: derive from memory


class TransferSpec(BaseModel):
    """Bandwidths for moving KV between tiers and peers (GB/s) plus a fixed latency."""

    model_config = ConfigDict(extra="forbid")

    # Assumed achievable rates; the links they stand for: docs/simulator.md.
    cpu_to_gpu_gbps: float = Field(25.0, gt=0)  # PCIe 4.0 x16
    disk_to_gpu_gbps: float = Field(5.0, gt=0)  # one NVMe SSD
    peer_gbps: float = Field(25.0, gt=0)  # one 200 Gb/s RDMA NIC
    latency_s: float = Field(0.0005, ge=0)
    allow_peer_fetch: bool = False  # most engines cannot pull KV from a peer


class CostModelConfig(BaseModel):
    """Everything the cost model needs; `CostModelConfig.load(path)` reads JSON or YAML."""

    model_config = ConfigDict(extra="forbid")

    model: ModelSpec = ModelSpec()
    gpu: GpuSpec = GpuSpec()
    engine: EngineSpec = EngineSpec()
    transfer: TransferSpec = TransferSpec()

    @classmethod
    def load(cls, path: str | Path) -> CostModelConfig:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read cost-model config {p}: {exc}") from None
        data: Any
        try:
            if p.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:
            raise ConfigError(f"cost-model config {p} is not valid JSON/YAML: {exc}") from None
        return cls.parse(data or {}, origin=str(p))

    @classmethod
    def parse(cls, data: dict[str, Any], origin: str = "config") -> CostModelConfig:
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(f"invalid cost-model {origin}: {exc}") from None

    def with_overrides(self, overrides: dict[str, Any]) -> CostModelConfig:
        """Apply dotted overrides such as {"gpu.prefill_mfu": 0.5} (from --cost flags)."""
        data = self.model_dump()
        for dotted, value in overrides.items():
            node = data
            *parents, leaf = dotted.split(".")
            for part in parents:
                if not isinstance(node.get(part), dict):
                    raise ConfigError(f"unknown cost-model section {part!r} in {dotted!r}")
                node = node[part]
            if leaf not in node:
                raise ConfigError(
                    f"unknown cost-model field {dotted!r}; known in this section: "
                    + ", ".join(sorted(node))
                )
            node[leaf] = value
        return self.parse(data, origin="override")
