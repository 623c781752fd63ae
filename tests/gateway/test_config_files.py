"""Gateway configuration files a user gets wrong: each is a one-line message naming
what is wrong and exit 2 (`quillcache gateway --config FILE`), never a traceback after
the engines were contacted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.config import load_config
from quillcache.index.registry import create_backend
from quillcache.routing.registry import create_router


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("first_byte_timeout_s: .inf\n", "finite number"),
        ("stall_timeout_s: .inf\n", "finite number"),
        ("connect_timeout_s: .inf\n", "finite number"),
        ("max_body_bytes: 100000000000000000000000\n", "less than or equal"),
    ],
)
def test_values_outside_their_range_are_config_errors(tmp_path: Path, text: str, said: str) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("workers: []\n" + text)
    with pytest.raises(ConfigError, match=said):
        load_config(path)


def test_a_file_that_is_not_utf8_says_so(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_bytes(b"\xff\xfeworkers: []\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(path)


def test_index_and_router_options_of_the_wrong_name_or_type_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="index backend 'native' options"):
        create_backend("native", bogus=1)
    with pytest.raises(ConfigError, match="router 'round-robin' options"):
        create_router("round-robin", seed=[1])


def test_the_gateway_command_exits_2_with_the_message(tmp_path: Path) -> None:
    path = tmp_path / "gateway.yaml"
    path.write_text("workers: []\nindex: native\nindex_options: {bogus: 1}\nport: 0\n")
    r = subprocess.run(
        [sys.executable, "-m", "quillcache", "gateway", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "options {'bogus': 1}" in r.stderr


@pytest.mark.parametrize(
    ("workers", "said"),
    [
        ([{"url": "http://"}], "has no valid host"),
        ([{"url": "http://foo bar:80"}], "has no valid host"),
        ([{"url": "http://127.0.0.1:notaport"}], "the port is not a number"),
        ([{"url": "http://127.0.0.1:8000"}, {"url": "http://127.0.0.1:8000/"}], "twice"),
    ],
)
def test_worker_urls_that_cannot_be_one_engine_each_are_refused(
    tmp_path: Path, workers: list[dict[str, str]], said: str
) -> None:
    import json

    path = tmp_path / "gateway.json"
    path.write_text(json.dumps({"workers": workers}))
    with pytest.raises(ConfigError, match=said):
        load_config(path)
