"""Trace replay on generated Mooncake-format fixtures."""

from __future__ import annotations

import json

import pytest

from quillcache.costmodel import CostModel
from quillcache.errors import ConfigError
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.trace import load_trace
from tests.sim.trace_fixture import (
    ideal_prefix_hit_rate,
    write_chained_trace,
    write_per_block_trace,
)

UNBOUNDED = 1 << 31
COST = CostModel()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("backend", ["memory", "native"])
def test_one_unbounded_worker_hits_the_ideal(tmp_path, seed: int, backend: str) -> None:
    path = tmp_path / "trace.jsonl"
    records = write_chained_trace(path, seed=seed)
    wl = load_trace(path)
    assert len(wl.requests) == len(records)
    res = run(wl, "round-robin", backend, SimConfig(1, UNBOUNDED, timing="none"), COST)
    got = res.summary()["block_hit_rate"]
    assert got == pytest.approx(ideal_prefix_hit_rate(records, 512, chained=True), abs=1e-6)
    assert got > 0.3  # the fixture has real reuse


def test_per_block_ids_reuse_only_under_the_same_prefix(tmp_path) -> None:
    path = tmp_path / "pb.jsonl"
    records = write_per_block_trace(path)
    with pytest.raises(ConfigError, match="not chained"):
        load_trace(path, block_size=64)
    wl = load_trace(path, block_size=64, chained=False)
    res = run(wl, "random", "native", SimConfig(1, UNBOUNDED, timing="none"), COST)
    want = ideal_prefix_hit_rate(records, 64, chained=False)
    assert res.summary()["block_hit_rate"] == pytest.approx(want, abs=1e-6)
    # treating the ids as chained would have found more (false) reuse
    assert want < ideal_prefix_hit_rate(records, 64, chained=True)


def test_every_router_is_bounded_by_the_single_worker_ideal(tmp_path) -> None:
    path = tmp_path / "trace.jsonl"
    records = write_chained_trace(path, sessions=40)
    ideal = ideal_prefix_hit_rate(records, 512, chained=True)
    wl = load_trace(path)
    from quillcache.routing import BUILTIN_ORDER

    for name in BUILTIN_ORDER:
        res = run(wl, name, "native", SimConfig(4, UNBOUNDED, timing="none"), COST)
        assert res.summary()["block_hit_rate"] <= ideal + 1e-9, name


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"timestamp": 0, "input_length": 10}', "hash_ids"),
        ("not json", "not a Mooncake trace record"),
        (
            '{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1]}',
            "cannot cover",
        ),
        # each a traceback before
        (
            '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [-1]}',
            "2\\*\\*64",
        ),
        (
            '{"timestamp": 0, "input_length": 512, "output_length": 1, '
            '"hash_ids": [18446744073709551616]}',
            "2\\*\\*64",
        ),
        (
            '{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1.5]}',
            "integers",
        ),
        ('{"timestamp": NaN, "input_length": 512, "output_length": 1, "hash_ids": [1]}', "finite"),
    ],
)
def test_bad_traces_are_config_errors(tmp_path, line: str, needle: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ConfigError, match=needle):
        load_trace(path)
    with pytest.raises(ConfigError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


def test_limit_and_time_order(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 3000, "input_length": 600, "output_length": 2, "hash_ids": [0, 1]},
        {"timestamp": 1000, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 2, "hash_ids": [0, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    wl = load_trace(path)
    assert [r.arrival_s for r in wl.requests] == [1.0, 2.0, 3.0]
    assert len(load_trace(path, limit=2).requests) == 2


def test_a_trace_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    path = tmp_path / "binary.jsonl"
    good = b'{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'
    path.write_bytes(good + b"\xff\xfe{}\n")
    with pytest.raises(ConfigError, match=r"binary\.jsonl:2: not UTF-8"):
        load_trace(path)
