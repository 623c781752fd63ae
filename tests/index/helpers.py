"""Shared helpers of the index tests: backends, event payloads, request keys."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from quillcache.events import encode as enc
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.index import IndexBackend, available_backends, create_backend

BS = 4  # block size of most tests


def backends() -> list[str]:
    return available_backends()


def make(name: str) -> IndexBackend:
    return create_backend(name)


def stored(
    hashes: Sequence[int],
    tokens: Sequence[int],
    parent: int | None = None,
    *,
    medium: str | None = "GPU",
    block_size: int = BS,
    lora_name: str | None = None,
    extra_keys: Sequence[Sequence[object] | None] | None = None,
    group_idx: int | None = 0,
    cache_salt: str | None = None,
) -> enc.BlockStored:
    return enc.BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(tokens),
        block_size=block_size,
        medium=medium,
        lora_name=lora_name,
        extra_keys=extra_keys,
        group_idx=group_idx,
        cache_salt=cache_salt,
    )


def removed(
    hashes: Sequence[int], medium: str | None = "GPU", group_idx: int = 0
) -> enc.BlockRemoved:
    return enc.BlockRemoved(block_hashes=list(hashes), medium=medium, group_idx=group_idx)


def payload(*events: enc.Event, dp_rank: int | None = 0) -> bytes:
    return enc.encode_batch(list(events), ts=1.0, dp_rank=dp_rank)


def keys(
    tokens: Sequence[int],
    *,
    block_size: int = BS,
    model: str = "",
    tokenizer: str = "",
    lora: str = "",
    tenant: str = "",
) -> np.ndarray:
    ns = namespace_id(model, tokenizer, lora, tenant, block_size)
    return np.array(content_keys(list(tokens), block_size, ns), dtype=np.uint64)


def toks(n_blocks: int, base: int = 0, block_size: int = BS) -> list[int]:
    return [base + i for i in range(n_blocks * block_size)]
