"""The simulator's fast event encoder writes exactly what the general encoder writes."""

from __future__ import annotations

import msgpack
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from quillcache.events.encode import BlockRemoved, BlockStored, encode_batch
from quillcache.sim import wire
from quillcache.sim.requests import (
    packed_rows,
    packed_synthetic_tokens,
    synthetic_block_tokens,
    synthetic_layout,
)

u64 = st.integers(0, 2**64 - 1)


@given(
    hashes=st.lists(u64, min_size=1, max_size=20),
    parent=st.one_of(st.none(), u64),
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=70),
    block_size=st.integers(1, 2**20),
    medium=st.sampled_from(["GPU", "CPU"]),
    removed=st.lists(u64, max_size=4),
    ts=st.floats(0, 1e10),
    rank=st.one_of(st.none(), st.integers(0, 300)),
)
def test_same_bytes_as_the_general_encoder(
    hashes, parent, tokens, block_size, medium, removed, ts, rank
) -> None:
    events = [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=block_size,
            medium=medium,
        )
    ] + [BlockRemoved(block_hashes=[h], medium=medium) for h in removed]
    toks = np.array(tokens, dtype=np.uint32)
    fast = [wire.block_stored(hashes, parent, toks, block_size, medium)]
    fast += [wire.block_removed(h, medium) for h in removed]
    assert wire.batch(ts, fast, rank) == encode_batch(events, ts, rank)


@given(
    ids=st.lists(st.integers(0, 2**40), max_size=6),
    block_size=st.sampled_from([1, 2, 3, 16, 512]),
)
def test_packed_synthetic_tokens_are_the_msgpack_of_the_tokens(ids, block_size) -> None:
    tokens = synthetic_block_tokens(ids, block_size)
    assert msgpack.unpackb(packed_synthetic_tokens(ids, block_size)) == tokens.tolist()
    assert wire.pack_tokens(tokens) == msgpack.packb(tokens.tolist())


def test_distinct_ids_get_distinct_tokens() -> None:
    ids = [*range(0, 200_000, 7), 2**32 - 1]
    blocks = synthetic_block_tokens(ids, 4).reshape(-1, 4)
    assert len({tuple(b) for b in blocks.tolist()}) == len(ids)


@given(
    removed=st.lists(st.one_of(u64, st.integers(2**32, 2**64 - 1)), max_size=30),
    medium=st.sampled_from(["GPU", "CPU"]),
    ts=st.floats(0, 1e10),
)
def test_removals_encoded_in_one_pass_match_the_general_encoder(removed, medium, ts) -> None:
    events = [BlockRemoved(block_hashes=[h], medium=medium) for h in removed]
    chunk = wire.blocks_removed(np.array(removed, dtype=np.uint64), medium)
    # one item standing for len(removed) events, as the engine model hands it over
    assert wire.batch(ts, [chunk], 0, len(removed)) == encode_batch(events, ts, 0)


@given(
    ids=st.lists(st.integers(0, 2**40), max_size=8),
    block_size=st.sampled_from([1, 2, 3, 16, 512]),
    data=st.data(),
)
def test_packed_rows_of_a_slice_are_the_slice_of_the_tokens(ids, block_size, data) -> None:
    start = data.draw(st.integers(0, len(ids)))
    end = data.draw(st.integers(start, len(ids)))
    rows, heads = synthetic_layout(ids, block_size)
    packed = packed_rows(rows[start:end], heads[start:end], block_size)
    assert msgpack.unpackb(packed) == synthetic_block_tokens(ids[start:end], block_size).tolist()
