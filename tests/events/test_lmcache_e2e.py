"""End to end with LMCache beside the engines (`engine-sim --lmcache mp`), real processes,
ZMQ and HTTP on 127.0.0.1: a prefix the engine evicted from its GPU is still in
LMCache's CPU tier, the gateway's index learns that from the engine's own KV events (no
LMCache controller), and routing sends the prefix to that engine as a CPU-tier hit.

LMCache's chunk size is the block size, or four blocks: then the gateway cuts each chunk
into the engine blocks it covers (`quillcache.events.chunks`), so the prompt keyed at
the engine's block size finds it.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import http_get, http_post, wait_for

BS = 16
GPU_BLOCKS = 48


def prompt(tag: str, blocks: int) -> str:
    """`blocks` full blocks of the builtin tokenizer (one token per byte)."""
    text = (f"[{tag}] " + "a shared document about offloaded caches " * 40)[: blocks * BS]
    assert len(text.encode()) == blocks * BS
    return text


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp("lmcache")
    yield from make_stack(workdir)


@pytest.fixture
def fresh_stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


@pytest.mark.parametrize("chunk", [BS, 4 * BS])
def test_an_offloaded_prefix_is_routed_to_its_engine_as_a_cpu_hit(
    fresh_stack: Stack, chunk: int
) -> None:
    stack = fresh_stack
    lmcache = ["--lmcache", "mp", "--lmcache-chunk-size", str(chunk)]
    common = ["--block-size", str(BS), "--num-gpu-blocks", str(GPU_BLOCKS)]
    engines = [stack.engine(extra=[*common, *lmcache], time_scale=0) for _ in range(2)]
    gw = stack.start_gateway({"router": "quillcache", "event_quiet_tail_s": 0.5})
    admin = stack.admin()
    workers = {str(w["id"]): w["url"] for w in admin.get("/admin/workers").json()["workers"]}
    assert sorted(workers.values()) == sorted(e.url for e in engines)

    def held(text: str) -> list[tuple[str, str, int]]:
        """(worker, medium, blocks) of every match the gateway's index has for `text`."""
        got = admin.post("/admin/lookup", json={"prompt": text}).json()["matches"]
        return [(str(m["worker"]), m["medium"], m["blocks"]) for m in got]

    text = prompt("offload-" + uuid.uuid4().hex[:8], 4)
    first = http_post(gw.url + "/v1/completions", json={"prompt": text, "max_tokens": 1})
    assert first.status_code == 200
    holder = first.headers["x-quillcache-worker"]
    on_both_tiers = {(holder, "GPU", 4), (holder, "CPU", 4)}
    wait_for(
        lambda: on_both_tiers <= set(held(text)),
        what="the index to learn the prefix on the GPU and in LMCache's CPU tier",
    )
    # Other prompts on the same engine push the prefix out of its GPU cache.
    for i in range(GPU_BLOCKS // 8 + 2):
        other = {"prompt": prompt(f"flood-{i}-{uuid.uuid4().hex[:6]}", 8), "max_tokens": 1}
        assert http_post(workers[holder] + "/v1/completions", json=other).is_success
    wait_for(
        lambda: held(text) == [(holder, "CPU", 4)],
        what="the prefix to be held in LMCache's CPU tier only",
    )
    follow = http_post(
        gw.url + "/v1/completions", json={"prompt": text + " and a question", "max_tokens": 1}
    )
    assert follow.status_code == 200
    assert follow.headers["x-quillcache-worker"] == holder
    page = http_get(gw.url + "/metrics").text
    split = metric(page, "quillcache_kv_chunks_split_total")
    assert (split > 0) if chunk > BS else (split == 0), split
    assert metric(page, "quillcache_kv_chunks_misaligned_total") == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lmcache", "mp", "--lmcache-chunk-size", "24"], "must be a multiple of --block-size"),
        (["--lmcache", "vllm", "--flavor", "sglang"], "--flavor vllm only"),
        (["--lmcache", "mp", "--lmcache-cpu-chunks", "0"], "must be at least 1"),
    ],
)
def test_bad_lmcache_options_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quillcache", "engine-sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr
