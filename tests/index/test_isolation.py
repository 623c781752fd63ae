"""Isolation: a request in one namespace never matches blocks stored in another.

Namespaces differ by tenant (vLLM's cache_salt in extra keys, SGLang's cache_salt
field), LoRA adapter, model, tokenizer or block size. Whatever the tokens, a request
computed in namespace A must get no match from blocks stored in namespace B, on
every backend; and the same request in its own namespace must match (so the test
can fail for the right reason).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.index import Match, create_backend
from tests.index.helpers import backends, payload, stored

names = st.sampled_from(["", "a", "b", "tenant-1", "sql-lora", "é"])


@st.composite
def namespaces(draw: st.DrawFn) -> dict[str, object]:
    return {
        "model": draw(names),
        "tokenizer": draw(names),
        "lora": draw(names),
        "tenant": draw(names),
        "block_size": draw(st.sampled_from([1, 2, 4, 16])),
    }


def store_in(index: object, worker: int, ns: dict[str, object], tokens: list[int]) -> None:
    """Store `tokens` from `worker` as an engine serving namespace `ns` would publish them."""
    bs = int(ns["block_size"])  # type: ignore[arg-type]
    n = len(tokens) // bs
    index.register_source(worker, model=ns["model"], tokenizer=ns["tokenizer"])  # type: ignore[attr-defined]
    lora = ns["lora"] or None
    first: list[object] = [x for x in (lora, ns["tenant"] or None) if x]
    extra = [first or None] + [[lora] if lora else None for _ in range(n - 1)]
    ev = stored(
        list(range(1, n + 1)),
        tokens[: n * bs],
        block_size=bs,
        lora_name=lora,  # type: ignore[arg-type]
        extra_keys=extra if any(extra) else None,
    )
    index.apply(worker, [payload(ev)])  # type: ignore[attr-defined]


def request(ns: dict[str, object], tokens: list[int]) -> np.ndarray:
    root = namespace_id(**ns)  # type: ignore[arg-type]
    return np.array(content_keys(tokens, int(ns["block_size"]), root), dtype=np.uint64)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", backends())
@given(
    a=namespaces(),
    b=namespaces(),
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=48),
)
def test_other_namespace_never_matches(
    name: str, a: dict[str, object], b: dict[str, object], tokens: list[int]
) -> None:
    if a["tenant"] == a["lora"] and a["tenant"]:
        a = {**a, "tenant": ""}  # a salt equal to the LoRA name is read as the LoRA name
    index = create_backend(name)
    try:
        store_in(index, 1, a, tokens)
        own = index.match(request(a, tokens))
        assert own == [Match(1, 0, "GPU", len(tokens) // int(a["block_size"]))]  # type: ignore[arg-type]
        if a != b:
            assert index.match(request(b, tokens)) == []
    finally:
        index.close()


@pytest.mark.parametrize("name", backends())
@given(tokens=st.lists(st.integers(0, 1000), min_size=8, max_size=32))
def test_sglang_salt_field_isolates_tenants(name: str, tokens: list[int]) -> None:
    index = create_backend(name)
    try:
        n = len(tokens) // 4
        for worker, salt in ((1, "tenant-a"), (2, "tenant-b")):
            ev = stored(list(range(1, n + 1)), tokens[: 4 * n], cache_salt=salt)
            index.apply(worker, [payload(ev)])
        for worker, salt in ((1, "tenant-a"), (2, "tenant-b")):
            keys = request({"tenant": salt, "block_size": 4}, tokens)
            assert [m.worker for m in index.match(keys)] == [worker]
        assert index.match(request({"block_size": 4}, tokens)) == []
    finally:
        index.close()
