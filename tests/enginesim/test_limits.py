"""An engine simulator refuses numbers no engine runs with, at start (exit 2, a line
naming the value), rather than serving until its first request (a NaN time scale
killed its scheduler loop while `/health` still answered 200)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from quillcache.enginesim.engine import EngineConfig
from quillcache.errors import ConfigError


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("time_scale", float("nan")),
        ("time_scale", float("inf")),
        ("time_scale", -1.0),
        ("block_size", 0),
        ("num_gpu_blocks", 0),
        ("max_num_seqs", 0),
        ("max_model_len", -5),
    ],
)
def test_an_engine_config_refuses_what_no_engine_runs_with(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=field):
        EngineConfig(**{field: value})  # type: ignore[arg-type]


def test_a_time_scale_of_zero_is_an_engine_without_waits() -> None:
    assert EngineConfig(time_scale=0.0).time_scale == 0.0


@pytest.mark.parametrize(
    ("command", "flag", "value", "said"),
    [
        ("engine-sim", "--time-scale", "nan", "engine-sim: time_scale must be a finite number"),
        ("engine-sim", "--num-gpu-blocks", "0", "engine-sim: num_gpu_blocks must be at least 1"),
        ("up", "--time-scale", "nan", "up: --time-scale must be a finite number"),
        ("up", "--time-scale", "-1", "up: --time-scale must be a finite number"),
        ("up", "--admin-token", "", "up: --admin-token must not be empty"),
        ("up", "--workdir", "/proc/no-such-dir", "up: cannot use --workdir /proc/no-such-dir"),
    ],
)
def test_the_commands_refuse_them_at_start(command: str, flag: str, value: str, said: str) -> None:
    port = ["--port", "0"] if command == "engine-sim" else []
    r = subprocess.run(
        [sys.executable, "-m", "quillcache", command, *port, flag, value],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert said in r.stderr
