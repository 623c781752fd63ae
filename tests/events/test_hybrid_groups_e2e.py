"""End to end with engines that publish KV-cache groups (`engine-sim --kv-groups 2`:
each store and removal once per group, as vLLM 0.34 publishes a full-attention plus
sliding-window model), real processes, ZMQ and HTTP on 127.0.0.1: the gateway's index
folds the groups (`quillcache.events.groups`) and routes a prefix to its holder, as it
does for a single-group engine (docs/kv-events.md, "KV-cache groups").
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.online.conftest import Stack, make_stack
from tests.online.helpers import http_get, http_post, wait_for

BS = 16


def prompt(tag: str, blocks: int) -> str:
    """`blocks` full blocks of the builtin tokenizer (one token per byte)."""
    text = (f"[{tag}] " + "a hybrid model keeps two kinds of cache " * 40)[: blocks * BS]
    assert len(text.encode()) == blocks * BS
    return text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp("groups")
    yield from make_stack(workdir)


def test_a_hybrid_engines_prefix_is_routed_to_its_holder(stack: Stack) -> None:
    extra = ["--block-size", str(BS), "--kv-groups", "2"]
    engines = [stack.engine(extra=extra, time_scale=0) for _ in range(2)]
    gw = stack.start_gateway({"router": "quillcache", "event_quiet_tail_s": 0.5})
    admin = stack.admin()
    workers = {str(w["id"]): w["url"] for w in admin.get("/admin/workers").json()["workers"]}
    assert sorted(workers.values()) == sorted(e.url for e in engines)

    def held(text: str) -> list[tuple[str, str, int]]:
        got = admin.post("/admin/lookup", json={"prompt": text}).json()["matches"]
        return [(str(m["worker"]), m["medium"], m["blocks"]) for m in got]

    text = prompt("hybrid-" + uuid.uuid4().hex[:8], 4)
    first = http_post(gw.url + "/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert first.status_code == 200
    holder = first.headers["x-quillcache-worker"]
    wait_for(
        lambda: held(text) == [(holder, "GPU", 4)],
        what="the index to hold the prefix in both groups of its engine",
    )
    for _ in range(3):
        follow = http_post(
            gw.url + "/v1/completions", json={"prompt": text + " and more", "max_tokens": 1}
        )
        assert follow.status_code == 200
        assert follow.headers["x-quillcache-worker"] == holder
    assert http_get(gw.url + "/metrics").is_success


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kv-groups", "0"], "must be in 1..32"),
        (["--kv-groups", "2", "--flavor", "sglang"], "--flavor vllm without --lmcache"),
        (["--kv-groups", "2", "--lmcache", "mp"], "--flavor vllm without --lmcache"),
    ],
)
def test_bad_kv_groups_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quillcache", "engine-sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
