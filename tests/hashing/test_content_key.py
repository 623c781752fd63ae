"""QuillCache's content key through the native API, against the Python reference and
the checked-in vectors (tests/vectors/content_key.json, also checked in Rust)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache import _native as nat
from quillcache.errors import HashingError
from quillcache.hashing import reference as ref

VECTORS: dict[str, Any] = json.loads(
    (Path(__file__).resolve().parent.parent / "vectors" / "content_key.json").read_text()
)


@pytest.mark.parametrize("ns", VECTORS["namespaces"], ids=lambda n: repr(n["model"]))
def test_namespace_vectors(ns: dict[str, Any]) -> None:
    fields = {k: v for k, v in ns.items() if k != "id"}
    assert nat.namespace_id(**fields) == ns["id"]
    namespace = nat.Namespace(**fields)
    assert namespace.id == ns["id"]
    assert (namespace.model, namespace.block_size, namespace.extra) == (
        ns["model"],
        ns["block_size"],
        ns["extra"],
    )


@pytest.mark.parametrize("chain", VECTORS["chains"], ids=lambda c: f"ns{c['namespace']}")
def test_chain_vectors(chain: dict[str, Any]) -> None:
    ns = VECTORS["namespaces"][chain["namespace"]]
    mm = chain.get("mm")
    if mm is not None:
        mm = [None if b is None else [tuple(i) for i in b] for b in mm]
    for dtype in (np.uint32, np.int64):
        keys = nat.content_keys(
            np.asarray(chain["tokens"], dtype=dtype), ns["block_size"], ns["id"], mm=mm
        )
        assert keys.dtype == np.uint64
        assert keys.tolist() == chain["keys"]
    if mm is None:
        fields = {k: v for k, v in ns.items() if k != "id"}
        assert nat.Namespace(**fields).content_keys(chain["tokens"]).tolist() == chain["keys"]


u32 = st.integers(0, 2**32 - 1)


@given(
    tokens=st.lists(u32, max_size=200),
    block_size=st.integers(1, 40),
    parent=st.integers(0, 2**64 - 1),
    dtype=st.sampled_from([np.uint32, np.int64]),
)
def test_native_equals_reference(
    tokens: list[int], block_size: int, parent: int, dtype: type
) -> None:
    got = nat.content_keys(np.asarray(tokens, dtype=dtype), block_size, parent)
    assert got.tolist() == ref.content_keys(tokens, block_size, parent)
    assert len(got) == len(tokens) // block_size  # a trailing partial block gets no key


@given(
    tokens=st.lists(u32, min_size=1, max_size=40),
    parent=st.integers(0, 2**64 - 1),
    mm=st.lists(st.tuples(st.text(max_size=6), st.integers(-(2**63), 2**63 - 1)), min_size=1),
)
def test_block_key_with_mm_items_equals_reference(
    tokens: list[int], parent: int, mm: list[tuple[str, int]]
) -> None:
    assert nat.block_key(parent, tokens, mm) == ref.block_key(parent, tokens, mm)
    assert nat.block_key(parent, tokens) == ref.block_key(parent, tokens)


def test_strided_arrays_are_read_correctly() -> None:
    tokens = np.arange(64, dtype=np.uint32)
    assert nat.content_keys(tokens[::2], 4, 9).tolist() == ref.content_keys(
        list(range(0, 64, 2)), 4, 9
    )


@given(
    seqs=st.lists(st.lists(u32, max_size=50), max_size=6),
    block_size=st.integers(1, 8),
    parent=st.integers(0, 2**64 - 1),
)
def test_batch_equals_per_sequence_calls(
    seqs: list[list[int]], block_size: int, parent: int
) -> None:
    flat = np.asarray([t for s in seqs for t in s], dtype=np.uint32)
    offsets = np.cumsum([0, *map(len, seqs)]).astype(np.int64)
    parents = np.arange(len(seqs), dtype=np.uint64) + np.uint64(parent % 2**32)
    keys, key_offsets = nat.content_keys_batch(flat, offsets, block_size, parents)
    for j, s in enumerate(seqs):
        expected = ref.content_keys(s, block_size, int(parents[j]))
        assert keys[key_offsets[j] : key_offsets[j + 1]].tolist() == expected
    keys2, _ = nat.content_keys_batch(flat, offsets, block_size, parent)
    assert keys2.tolist() == [k for s in seqs for k in ref.content_keys(s, block_size, parent)]


@pytest.mark.parametrize(("bad", "index"), [(-1, 3), (2**32, 3), (-(2**63), 3)])
def test_int64_out_of_range_is_rejected_naming_the_index(bad: int, index: int) -> None:
    tokens = np.array([1, 2, 3, bad, 2**40], dtype=np.int64)
    with pytest.raises(HashingError, match=f"index {index}"):
        nat.content_keys(tokens, 2, 0)


@pytest.mark.parametrize(
    "tokens",
    [np.zeros(4, dtype=np.float32), np.zeros((2, 2), dtype=np.uint32), "abc", [1, "x"]],
)
def test_other_token_inputs_get_a_typed_error(tokens: object) -> None:
    with pytest.raises(HashingError, match="tokens must be"):
        nat.content_keys(tokens, 2, 0)


@pytest.mark.parametrize("block_size", [0, -1, 2**32])
def test_bad_block_size_is_rejected(block_size: int) -> None:
    with pytest.raises(HashingError, match="block_size"):
        nat.content_keys(np.zeros(4, dtype=np.uint32), block_size, 0)
    with pytest.raises(HashingError, match="block_size"):
        nat.Namespace(model="m", block_size=block_size)


def test_bad_batch_offsets_are_rejected() -> None:
    flat = np.zeros(10, dtype=np.uint32)
    with pytest.raises(HashingError, match="offsets"):
        nat.content_keys_batch(flat, np.array([0, 5, 3], dtype=np.int64), 2, 0)
    with pytest.raises(HashingError, match="offsets"):
        nat.content_keys_batch(flat, np.array([0, 11], dtype=np.int64), 2, 0)
    with pytest.raises(HashingError, match="parents"):
        nat.content_keys_batch(
            flat, np.array([0, 5, 10], dtype=np.int64), 2, np.zeros(3, np.uint64)
        )


def test_namespaces_isolate_tenants_and_adapters() -> None:
    tokens = np.arange(32, dtype=np.uint32)
    variants = [
        nat.Namespace(model="m"),
        nat.Namespace(model="m", tenant="a"),
        nat.Namespace(model="m", lora="l"),
        nat.Namespace(model="m", tokenizer="t"),
        nat.Namespace(model="m", extra=["x"]),
    ]
    key_sets = [set(ns.content_keys(tokens).tolist()) for ns in variants]
    for i, a in enumerate(key_sets):
        for b in key_sets[i + 1 :]:
            assert not a & b
    assert nat.Namespace(model="m") == nat.Namespace(model="m")
    assert hash(nat.Namespace(model="m")) == hash(nat.Namespace(model="m"))
    assert nat.Namespace(model="m").canonical_bytes().startswith(b"quillcache-ns-v1")
