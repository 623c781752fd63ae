"""The cost model: monotone where physics says so, configurable, typed errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.errors import ConfigError

COST = CostModel()


@given(n=st.integers(1, 200_000), m=st.integers(1, 200_000), ctx=st.integers(0, 100_000))
def test_prefill_grows_with_new_tokens_and_context(n: int, m: int, ctx: int) -> None:
    lo, hi = sorted((n, m))
    assert COST.prefill_time(lo, ctx) <= COST.prefill_time(hi, ctx)
    assert COST.prefill_time(n, 0) <= COST.prefill_time(n, ctx)
    # reusing a prefix never makes prefilling the whole prompt cheaper than the suffix
    assert COST.prefill_time(n, ctx) <= COST.prefill_time(n + ctx, 0) + 1e-12


@given(b=st.integers(1, 512), c=st.integers(1, 512), ctx=st.floats(0, 32_000))
def test_decode_step_grows_with_batch(b: int, c: int, ctx: float) -> None:
    lo, hi = sorted((b, c))
    assert COST.decode_step_time(lo, ctx) <= COST.decode_step_time(hi, ctx)


def test_defaults_are_in_a_plausible_range() -> None:
    # Llama-3.1-8B on one A100-80GB: ~10k prompt tokens/s, ~15 ms per decode step at
    # batch 1 (docs/simulator.md lists the published figures these are checked against).
    assert 0.6 < COST.prefill_time(8192) < 1.2
    assert 0.010 < COST.decode_step_time(1, 1000) < 0.025
    assert COST.config.model.kv_bytes_per_token == 131072
    assert 20_000 < COST.kv_capacity_blocks(16) < 40_000


def test_transfer_tiers_order() -> None:
    assert COST.transfer_time(0, "cpu") == 0
    assert COST.transfer_time(10, "cpu") < COST.transfer_time(10, "disk")


def test_config_from_json_and_yaml_files(tmp_path) -> None:
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"gpu": {"prefill_mfu": 0.3}, "engine": {"block_size": 32}}))
    cfg = CostModelConfig.load(j)
    assert cfg.gpu.prefill_mfu == 0.3 and cfg.engine.block_size == 32
    assert CostModel(cfg).prefill_time(4096) > COST.prefill_time(4096)
    y = tmp_path / "c.yaml"
    y.write_text("transfer:\n  cpu_to_gpu_gbps: 50\n")
    assert CostModelConfig.load(y).transfer.cpu_to_gpu_gbps == 50


@pytest.mark.parametrize(
    "data, needle",
    [
        ({"gpu": {"prefill_mfu": 2}}, "prefill_mfu"),
        ({"gpu": {"no_such": 1}}, "no_such"),
        ({"engine": {"block_size": 0}}, "block_size"),
    ],
)
def test_bad_config_is_a_config_error(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        CostModelConfig.parse(data)


def test_overrides(tmp_path) -> None:
    cfg = CostModelConfig().with_overrides({"gpu.hbm_gbps": 3350, "engine.block_size": 64})
    assert cfg.gpu.hbm_gbps == 3350 and cfg.engine.block_size == 64
    with pytest.raises(ConfigError, match="unknown cost-model field"):
        CostModelConfig().with_overrides({"gpu.nope": 1})
    with pytest.raises(ConfigError, match="unknown cost-model section"):
        CostModelConfig().with_overrides({"nope.x": 1})
    with pytest.raises(ConfigError, match="cannot read"):
        CostModelConfig.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ConfigError, match="not valid"):
        CostModelConfig.load(bad)
