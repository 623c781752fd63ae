"""The engine-hash half of the parity check (`quillcache.gateway.engine_hashes`).

The engine's side of each case is what an engine would publish, made with the project's
vLLM-parity hashing (checked against vLLM's own code: tests/hashing and the golden values
below), vLLM's pickle-based `sha256` as vLLM defines it, or the engine simulator's opaque
hashes, written by the project's vLLM-format encoder and read back by the native decoder:
the checker sees decoded events, as in the gateway.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache._native import decode_batch
from quillcache.events.encode import encode_batch
from quillcache.events.types import BlockStored, Event
from quillcache.gateway.engine_hashes import (
    VLLM_DEFAULT_SEED,
    PublishedChain,
    find_chain,
    hash_algorithm_of,
    judge,
    speaks_sglang,
)
from quillcache.hashing import vllm_event_hashes
from quillcache.identity import content_keys, namespace
from quillcache.sim.engine import engine_hash

BS = 16
TOKENS = [(i * 7919) % 32000 + 3 for i in range(5 * BS + 7)]  # 5 full blocks and a tail
FULL = 5

# vLLM 0.32's own sha256_cbor chain with PYTHONHASHSEED=0 (`kv_cache_utils.init_none_hash`
# then `hash_block_tokens`, run in the real-vLLM venv): tokens 1..12, block size 4.
VLLM_SEED0_1_TO_12 = [2164874634404590027, 17270480062156288726, 15775340307203827378]


def _published(
    hashes: Sequence[int],
    tokens: Sequence[int],
    block_size: int,
    *,
    split: int | None = None,
    extra_keys: Sequence[object] | None = None,
) -> list[Event]:
    """The BlockStored events an engine publishes for one prompt (in one event, or two
    chained ones split at block `split`), through the wire and back."""
    n = len(hashes)
    cuts = [0, n] if split is None else [0, split, n]
    events: list[Event] = []
    for a, b in itertools.pairwise(cuts):
        events.append(
            BlockStored(
                block_hashes=list(hashes[a:b]),
                parent_block_hash=None if a == 0 else hashes[a - 1],
                token_ids=list(tokens[a * block_size : b * block_size]),
                block_size=block_size,
                extra_keys=None if extra_keys is None else list(extra_keys[a:b]),  # type: ignore[arg-type]
            )
        )
    return list(decode_batch(encode_batch(events, ts=1.0)).events)


def _chain(events: list[Event], tokens: Sequence[int] = TOKENS) -> PublishedChain:
    chain = find_chain(events, tokens)
    assert chain is not None
    return chain


def _vllm_pickle_sha256(tokens: Sequence[int], block_size: int, seed: str) -> list[int]:
    """vLLM's default `sha256` chain as `vllm/utils/hashing.py` defines it: SHA-256 of
    pickle.dumps(obj, HIGHEST_PROTOCOL), NONE_HASH = that hash of the seed string."""

    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    parent, out = h(seed), []
    for i in range(len(tokens) // block_size):
        parent = h((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), None))
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


def test_the_seed_follows_vllms_own_values() -> None:
    assert vllm_event_hashes(list(range(1, 13)), 4, seed="0").tolist() == VLLM_SEED0_1_TO_12


def test_match() -> None:
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS).tolist()
    v = judge(
        TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=_chain(_published(hashes, TOKENS, BS))
    )
    assert (v.state, v.detail) == ("ok", "")
    assert v.published == v.predicted == hashes and v.seed == VLLM_DEFAULT_SEED


def test_match_with_a_configured_seed_and_a_chain_over_two_events() -> None:
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS, seed="1234").tolist()
    chain = _chain(_published(hashes, TOKENS, BS, split=2))
    assert chain.hashes == hashes
    assert str(judge(TOKENS, BS, algorithm="sha256_cbor", seed="1234", chain=chain)) == "ok"


def test_wrong_seed_the_engine_sets_pythonhashseed() -> None:
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS, seed="42").tolist()
    chain = _chain(_published(hashes, TOKENS, BS))
    v = judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=chain)
    assert v.state == "mismatch"
    assert v.detail.startswith("seed:") and "PYTHONHASHSEED" in v.detail
    assert v.published == hashes and v.predicted != hashes


def test_wrong_seed_the_engine_uses_vllms_default() -> None:
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS).tolist()
    chain = _chain(_published(hashes, TOKENS, BS))
    v = judge(TOKENS, BS, algorithm="sha256_cbor", seed="42", chain=chain)
    assert v.state == "mismatch"
    assert v.detail.startswith("seed:") and repr(VLLM_DEFAULT_SEED) in v.detail
    assert "'42'" in v.detail


def test_other_algorithm_stated_by_the_engine_is_not_predictable() -> None:
    """vLLM's default: the pickle-based sha256 (with vLLM's default seed, as vLLM 0.32
    uses when PYTHONHASHSEED is unset); also every other vLLM algorithm."""
    hashes = _vllm_pickle_sha256(TOKENS, BS, VLLM_DEFAULT_SEED)
    chain = _chain(_published(hashes, TOKENS, BS))
    for algo in ("sha256", "xxhash", "xxhash_cbor"):
        v = judge(TOKENS, BS, algorithm=algo, seed=None, chain=chain)
        assert v.state == "not predictable", algo
        assert f"'{algo}'" in v.detail and "sha256_cbor" in v.detail


def test_other_algorithm_not_stated_is_a_mismatch_naming_the_algorithm() -> None:
    hashes = _vllm_pickle_sha256(TOKENS, BS, VLLM_DEFAULT_SEED)
    v = judge(TOKENS, BS, algorithm=None, seed=None, chain=_chain(_published(hashes, TOKENS, BS)))
    assert v.state == "mismatch" and v.detail.startswith("hash algorithm:")


def test_other_block_size() -> None:
    """The engine hashes 32-token blocks where the gateway predicts 16-token ones."""
    hashes = vllm_event_hashes(TOKENS[: 2 * 2 * BS], 2 * BS).tolist()
    chain = _chain(_published(hashes, TOKENS, 2 * BS))
    assert chain.block_size == 2 * BS
    v = judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=chain)
    assert v.state == "mismatch" and v.detail.startswith("block size:")
    assert "32 tokens" in v.detail and "predicted exactly" in v.detail
    # another seed on top: still named for the block size, without the "exactly"
    other = vllm_event_hashes(TOKENS[: 2 * 2 * BS], 2 * BS, seed="7").tolist()
    v = judge(
        TOKENS,
        BS,
        algorithm="sha256_cbor",
        seed=None,
        chain=_chain(_published(other, TOKENS, 2 * BS)),
    )
    assert v.detail.startswith("block size:") and "exactly" not in v.detail


def test_the_engine_simulators_hashes() -> None:
    """The simulator publishes opaque hashes of its content keys and states the algorithm
    `xxh3_64_sim` in its /metrics: not predictable; unstated, a mismatch."""
    keys = content_keys(TOKENS, BS, namespace("m", "", "", "", BS)).tolist()
    hashes = [engine_hash(k, 0) for k in keys]
    chain = _chain(_published(hashes, TOKENS, BS))
    v = judge(TOKENS, BS, algorithm="xxh3_64_sim", seed=None, chain=chain)
    assert v.state == "not predictable" and "'xxh3_64_sim'" in v.detail
    assert judge(TOKENS, BS, algorithm=None, seed=None, chain=chain).state == "mismatch"


def test_sglang_and_no_published_blocks() -> None:
    v = judge(TOKENS, BS, algorithm=None, seed=None, chain=None, sglang=True)
    assert v.state == "not predictable" and "SGLang" in v.detail
    assert judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=None).state == "skipped"
    empty = PublishedChain([], [], BS)
    assert judge(TOKENS, BS, algorithm=None, seed=None, chain=empty).state == "skipped"


def test_multimodal_extra_keys_from_the_events_enter_the_prediction() -> None:
    mm: list[object] = [[["img-0f3a", 2]], None, [["img-0f3a", -14]], None, None]
    vllm_keys = [[("mm", "img-0f3a", 2)], None, [("mm", "img-0f3a", -14)], None, None]
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS, extra_keys=vllm_keys).tolist()
    assert hashes != vllm_event_hashes(TOKENS[: FULL * BS], BS).tolist()
    chain = _chain(_published(hashes, TOKENS, BS, extra_keys=mm))
    assert str(judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=chain)) == "ok"


def test_a_salted_prompt_is_predicted_with_its_salt_on_block_0() -> None:
    """vLLM hashes ("cache_salt", salt) into block 0 and publishes the bare salt."""
    vllm_keys: list[object] = [[("cache_salt", "tenant-a")], None, None, None, None]
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS, extra_keys=vllm_keys).tolist()  # type: ignore[arg-type]
    events = _published(hashes, TOKENS, BS, extra_keys=[["tenant-a"], None, None, None, None])
    assert str(judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=_chain(events))) == "ok"
    # the same salt published on block 1 is not one vLLM hashes there: not rebuilt
    moved = _published(hashes, TOKENS, BS, extra_keys=[None, ["tenant-a"], None, None, None])
    v = judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=_chain(moved))
    assert v.state == "not predictable" and "block 1" in v.detail


def test_a_lora_prompt_is_not_predictable() -> None:
    """vLLM hashes ("lora", name, path) and publishes only the name."""
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS).tolist()
    events = [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=TOKENS[: FULL * BS],
            block_size=BS,
            lora_id=1,
            lora_name="sql",
            extra_keys=[["sql"]] * FULL,
        )
    ]
    decoded = list(decode_batch(encode_batch(events, ts=1.0)).events)
    v = judge(TOKENS, BS, algorithm="sha256_cbor", seed=None, chain=_chain(decoded))
    assert v.state == "not predictable" and "LoRA" in v.detail and v.published == hashes


def test_find_chain_amid_other_traffic() -> None:
    hashes = vllm_event_hashes(TOKENS[: FULL * BS], BS).tolist()
    other_tokens = [t + 1 for t in TOKENS]
    other = vllm_event_hashes(other_tokens[: 3 * BS], BS).tolist()
    events = (
        _published(other, other_tokens, BS)
        + _published(hashes, TOKENS, BS, split=3)[:1]
        + _published(other[::-1], other_tokens, BS)  # not a chain of ours
        + _published(hashes, TOKENS, BS, split=3)[1:]
    )
    chain = _chain(events)
    assert chain.hashes == hashes and chain.token_ids == TOKENS[: FULL * BS]
    assert find_chain(events, [t + 2 for t in TOKENS]) is None
    # blocks the generated tokens filled, past the prompt's full blocks, are left out
    longer = [*TOKENS, *range(100, 100 + 2 * BS - 7)]
    more = vllm_event_hashes(longer[: 6 * BS], BS).tolist()
    assert _chain(_published(more, longer, BS)).hashes == hashes


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=BS, max_size=6 * BS),
    engine_seed=st.sampled_from([None, "0", "42", "random"]),
    gateway_seed=st.sampled_from([None, "0", "42", "random"]),
    split=st.integers(1, 5),
)
def test_ok_exactly_when_the_seeds_agree(
    tokens: list[int], engine_seed: str | None, gateway_seed: str | None, split: int
) -> None:
    n = len(tokens) // BS
    hashes = vllm_event_hashes(tokens, BS, seed=engine_seed or VLLM_DEFAULT_SEED).tolist()
    events = _published(hashes, tokens, BS, split=split if split < n else None)
    v = judge(tokens, BS, algorithm="sha256_cbor", seed=gateway_seed, chain=_chain(events, tokens))
    assert (v.state == "ok") == (engine_seed == gateway_seed)
    if v.state != "ok":
        assert v.detail.startswith("seed:")


VLLM_CONFIG_INFO = (
    "# HELP vllm:cache_config_info Information of the LLMCache configuration.\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",'
    'engine="0",prefix_caching_hash_algo="sha256_cbor",sliding_window="None"} 1.0\n'
)


@pytest.mark.parametrize(
    ("page", "algo"),
    [
        (VLLM_CONFIG_INFO, "sha256_cbor"),
        (VLLM_CONFIG_INFO.replace('"sha256_cbor"', '"sha256"'), "sha256"),
        ('vllm:cache_config_info{block_size="16"} 1.0\n', None),
        ('vllm:num_requests_running{prefix_caching_hash_algo="x"} 1.0\n', None),
        ("", None),
    ],
)
def test_hash_algorithm_of(page: str, algo: str | None) -> None:
    assert hash_algorithm_of(page) == algo


def test_speaks_sglang() -> None:
    assert speaks_sglang('sglang:num_running_reqs{model_name="m"} 0.0\n')
    assert not speaks_sglang(VLLM_CONFIG_INFO)
    assert not speaks_sglang("")
