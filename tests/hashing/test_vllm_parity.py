"""vLLM `sha256_cbor` parity: every vector of specs/block-hashing.md, and a small
independent Python oracle (hashlib + a CBOR writer) for seeds, extra keys, parents."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache import _native as nat
from quillcache.errors import HashingError

NONE_HASH = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
CHAIN = [
    ("58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111", 9561501211280363793),
    ("e1bc29393a2da9fd798f35ff04d215f846aee6df4b803ce3d43b57df56b58fb1", 15292913576410714033),
    ("321cf73a943519e37f9c8afa804132a5b9076e22b40b2d5fe6f7a2886960a68a", 16642949654738151050),
]
EXTRA_BLOCK0 = (
    ("lora", "my-lora", "/adapters/my-lora"),
    ("mm", "imghash", 2),
    ("cache_salt", "tenant-a"),
)


def test_none_hash_of_the_default_seed() -> None:
    assert nat.vllm_none_hash().hex() == NONE_HASH
    assert nat.vllm_none_hash("vllm-none-hash").hex() == NONE_HASH


@pytest.mark.parametrize("dtype", [np.uint32, np.int64])
def test_chain_vector(dtype: type) -> None:
    tokens = np.arange(1, 13, dtype=dtype)
    assert [d.hex() for d in nat.vllm_block_hashes(tokens, 4)] == [h for h, _ in CHAIN]
    assert nat.vllm_event_hashes(tokens, 4).tolist() == [v for _, v in CHAIN]
    # A partial trailing block gets no hash; a given parent continues the chain.
    assert len(nat.vllm_block_hashes(tokens[:11], 4)) == 2
    tail = nat.vllm_block_hashes(tokens[4:], 4, parent=bytes.fromhex(CHAIN[0][0]))
    assert [d.hex() for d in tail] == [h for h, _ in CHAIN[1:]]


def test_extra_keys_vector() -> None:
    (digest,) = nat.vllm_block_hashes([1, 2, 3, 4], 4, extra_keys=[EXTRA_BLOCK0])
    assert digest.hex().startswith("41b93c4c")
    assert digest.hex().endswith("7d30c4")


# ---- an independent oracle -----------------------------------------------------------


def _head(major: int, n: int) -> bytes:
    for limit, extra, fmt in (
        (24, None, ""),
        (1 << 8, 24, ">B"),
        (1 << 16, 25, ">H"),
        (1 << 32, 26, ">I"),
        (1 << 64, 27, ">Q"),
    ):
        if n < limit:
            return bytes([major << 5 | (n if extra is None else extra)]) + (
                struct.pack(fmt, n) if fmt else b""
            )
    raise ValueError(n)


def _cbor(x: Any) -> bytes:
    if x is None:
        return b"\xf6"
    if isinstance(x, bytes):
        return _head(2, len(x)) + x
    if isinstance(x, str):
        return _head(3, len(x.encode())) + x.encode()
    if isinstance(x, int):
        return _head(0, x) if x >= 0 else _head(1, -1 - x)
    return _head(4, len(x)) + b"".join(_cbor(i) for i in x)


def _oracle(tokens: list[int], bs: int, seed: str, extra: list[Any] | None) -> list[bytes]:
    parent = hashlib.sha256(_cbor(seed)).digest()
    out = []
    for i in range(len(tokens) // bs):
        block_extra = extra[i] if extra is not None and i < len(extra) else None
        parent = hashlib.sha256(
            _cbor([parent, tokens[i * bs : (i + 1) * bs], block_extra])
        ).digest()
        out.append(parent)
    return out


items = st.one_of(st.text(max_size=20), st.integers(-(2**64), 2**64 - 1), st.binary(max_size=40))
block_extra = st.none() | st.lists(st.lists(items, max_size=3).map(tuple), max_size=3).map(tuple)


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    bs=st.integers(1, 30),
    seed=st.sampled_from(["vllm-none-hash", "0", "42", "12345678901234567890123"]),
    extra=st.none() | st.lists(block_extra, max_size=5),
)
def test_matches_an_independent_oracle(
    tokens: list[int], bs: int, seed: str, extra: list[Any] | None
) -> None:
    expected = _oracle(tokens, bs, seed, extra)
    assert nat.vllm_block_hashes(tokens, bs, seed=seed, extra_keys=extra) == expected
    events = nat.vllm_event_hashes(tokens, bs, seed=seed, extra_keys=extra)
    assert events.tolist() == [int.from_bytes(d[-8:], "big") for d in expected]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parent": b"short"}, "32-byte"),
        ({"extra_keys": [(("x", 1.5),)]}, "str, int or bytes"),
        ({"extra_keys": [(("x", True),)]}, "str, int or bytes"),
        ({"extra_keys": [(("x", 2**64),)]}, "CBOR"),
        ({"extra_keys": [("lora",)]}, "tuple of tuples"),
        ({"extra_keys": 5}, "extra_keys"),
    ],
)
def test_bad_inputs_get_typed_errors(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(HashingError, match=match):
        nat.vllm_block_hashes([1, 2, 3, 4], 4, **kwargs)
