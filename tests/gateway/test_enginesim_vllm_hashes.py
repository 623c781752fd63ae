"""The engine simulator's `--prefix-caching-hash-algo sha256_cbor`: the block hashes its
KV events carry are vLLM's (`vllm_event_hashes`, the Rust reproduction of vLLM 0.32's
`hash_block_tokens` chain), parents included, for any prompts, seed, salt and LoRA; with
`sha256` they are SHA-256 of the pickled tuple, chained the same way."""

from __future__ import annotations

import asyncio
import hashlib
import pickle

from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache import _native
from quillcache.enginesim.engine import EngineConfig, SimEngine
from quillcache.events.types import BlockStored
from quillcache.gateway.engine_hashes import find_chain
from quillcache.hashing import vllm_event_hashes

BS = 4


def _published(
    config: EngineConfig, prompts: list[list[int]], salt: str = "", lora: str = ""
) -> list[object]:
    """Serve the prompts one after another; every event the engine published."""
    published: list[bytes] = []

    async def run() -> None:
        engine = SimEngine(config, publish=published.append)
        for prompt in prompts:
            async for _ in engine.generate(prompt, 1, lambda i: i, salt=salt, lora=lora):
                pass

    asyncio.run(asyncio.wait_for(run(), 20))
    return [ev for p in published for ev in _native.decode_batch(p).events]


def _config(algo: str, seed: str | None) -> EngineConfig:
    return EngineConfig(
        block_size=BS,
        num_gpu_blocks=256,
        time_scale=0.0,
        lora_modules=["adapter-a"],
        prefix_caching_hash_algo=algo,
        hash_seed=seed,
    )


tokens = st.lists(st.integers(0, 50_000), min_size=BS, max_size=6 * BS)


@settings(max_examples=25, deadline=None)
@given(
    shared=tokens,
    tails=st.lists(st.lists(st.integers(0, 50_000), max_size=3 * BS), min_size=1, max_size=3),
    seed=st.one_of(st.none(), st.sampled_from(["0", "42", "vllm-none-hash", "x"])),
)
def test_sha256_cbor_hashes_are_vllm_event_hashes(
    shared: list[int], tails: list[list[int]], seed: str | None
) -> None:
    """Prompts sharing a prefix: the later ones' blocks chain from cached parents."""
    prompts = [shared + tail for tail in tails]
    events = _published(_config("sha256_cbor", seed), prompts)
    stored = [e for e in events if isinstance(e, BlockStored)]
    known = {h for e in stored for h in e.block_hashes}
    for prompt in prompts:
        n = len(prompt) // BS
        predicted = vllm_event_hashes(
            prompt[: n * BS], BS, seed="vllm-none-hash" if seed is None else seed
        ).tolist()
        assert set(predicted) <= known  # every full prompt block, cached or stored now
        chain = find_chain(events, prompt)
        assert chain is not None and chain.hashes == predicted[: len(chain.hashes)]
    # each event's parent is vLLM's hash of the block it follows
    assert all(e.parent_block_hash is None or e.parent_block_hash in known for e in stored)


def test_sha256_cbor_folds_the_salt_and_the_lora_adapter_as_vllm_does() -> None:
    prompt = list(range(100, 100 + 3 * BS))
    salted = find_chain(_published(_config("sha256_cbor", "7"), [prompt], salt="s1"), prompt)
    assert salted is not None
    keys = [[("cache_salt", "s1")], None, None]
    assert salted.hashes == vllm_event_hashes(prompt, BS, seed="7", extra_keys=keys).tolist()
    assert salted.hashes != vllm_event_hashes(prompt, BS, seed="7").tolist()
    lora = find_chain(_published(_config("sha256_cbor", None), [prompt], lora="adapter-a"), prompt)
    assert lora is not None and lora.lora_name == "adapter-a"
    lora_keys: list[list[tuple[str, ...]] | None] = [[("lora", "adapter-a", "adapter-a")]] * 3
    assert lora.hashes == vllm_event_hashes(prompt, BS, extra_keys=lora_keys).tolist()


def test_sha256_hashes_are_the_pickled_chain() -> None:
    """vLLM's default: SHA-256 of pickle((parent digest, tokens, extra keys)); NONE_HASH is
    SHA-256 of the pickled seed (`init_none_hash`)."""
    prompt = list(range(7, 7 + 3 * BS))

    def sha(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent = sha("vllm-none-hash")
    expected = []
    for i in range(3):
        parent = sha((parent, tuple(prompt[i * BS : (i + 1) * BS]), None))
        expected.append(int.from_bytes(parent[-8:], "big"))
    chain = find_chain(_published(_config("sha256", None), [prompt]), prompt)
    assert chain is not None and chain.hashes == expected
    assert chain.hashes != vllm_event_hashes(prompt, BS).tolist()


def test_the_default_publishes_the_models_own_hashes() -> None:
    prompt = list(range(3 * BS))
    chain = find_chain(_published(_config("xxh3_64_sim", None), [prompt]), prompt)
    assert chain is not None and len(chain.hashes) == 3
    assert chain.hashes != vllm_event_hashes(prompt, BS).tolist()


def test_bad_hashing_flags_exit_2() -> None:
    import subprocess
    import sys

    for extra in (
        ["--hash-seed", "1"],  # a seed without a vLLM algorithm
        ["--prefix-caching-hash-algo", "sha256_cbor", "--flavor", "sglang"],
    ):
        r = subprocess.run(
            [sys.executable, "-m", "quillcache", "engine-sim", "--port", "0", *extra],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert "engine-sim: " in r.stderr and "hash" in r.stderr
