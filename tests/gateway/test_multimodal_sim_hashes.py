"""The engine simulator's image prompts: what it publishes is what vLLM would, and what
the gateway's engine-hash check (`engine_hashes.judge`) predicts.

For prompts with images anywhere, salts and adapters: the BlockStored events carry
vLLM's untagged extra keys (adapter name, `[identifier, offset]` per image, cache salt
on block 0), and with `--prefix-caching-hash-algo sha256_cbor` hashes equal to
`vllm_event_hashes` with vLLM's tagged keys; the gateway's check judges them "ok", and
the index's keys from those events are the gateway's content keys for the request."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache import _native
from quillcache.enginesim.engine import EngineConfig, SimEngine
from quillcache.gateway.engine_hashes import find_chain, judge
from quillcache.index.memory import MemoryIndex
from quillcache.tokenization.multimodal import MmItem, block_mm_keys

BS = 4


def _serve(
    config: EngineConfig, prompt: list[int], mm: object, salt: str, lora: str
) -> list[bytes]:
    published: list[bytes] = []

    async def run() -> None:
        engine = SimEngine(config, publish=published.append)
        gen = engine.generate(prompt, 1, lambda i: i, salt=salt, lora=lora, mm=mm)
        async for _ in gen:
            pass

    asyncio.run(asyncio.wait_for(run(), 20))
    return published


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 9)), min_size=1, max_size=3),
    tail=st.integers(0, 9),
    salt=st.sampled_from(["", "tenant-a"]),
    lora=st.sampled_from(["", "adapter-a"]),
)
def test_image_blocks_publish_vllms_keys_and_hashes(
    layout: list[tuple[int, int]], tail: int, salt: str, lora: str
) -> None:
    items, at = [], 0
    for i, (gap, n) in enumerate(layout):
        items.append(MmItem(f"{i:064x}", at + gap, n))
        at += gap + n
    prompt = [(7 * i) % 255 for i in range(max(at + tail, BS))]
    for it in items:
        prompt[it.offset : it.offset + it.length] = [256] * it.length
    mm = block_mm_keys(items, len(prompt), BS)
    config = EngineConfig(
        block_size=BS,
        num_gpu_blocks=256,
        time_scale=0.0,
        lora_modules=["adapter-a"],
        prefix_caching_hash_algo="sha256_cbor",
    )
    published = _serve(config, prompt, mm, salt, lora)
    events = [ev for p in published for ev in _native.decode_batch(p).events]
    chain = find_chain(events, prompt)
    full = len(prompt) // BS
    assert chain is not None and len(chain.hashes) == full
    assert [
        [(k.hash, k.offset) for k in e or () if not isinstance(k, str)] or None
        for e in chain.extra_keys
    ] == mm
    if not lora:  # a LoRA block hashes the adapter's path, which events drop
        verdict = judge(prompt, BS, algorithm="sha256_cbor", seed=None, chain=chain)
        assert verdict.state == "ok", verdict
    # the index's keys from the events are the gateway's keys for the request
    index = MemoryIndex()
    index.register_source(0, model="sim-model")
    index.apply(0, published)
    ns = _native.namespace_id("sim-model", "", lora, salt, BS)
    keys = _native.content_keys(prompt, BS, ns, mm=mm)
    assert [m.blocks for m in index.match(keys)] == [full]
