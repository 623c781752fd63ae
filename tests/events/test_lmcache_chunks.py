"""LMCache's chunks cut into engine blocks (`quillcache.events.chunks.ChunkSplitter`).

The reference: the same residency told at the engine's block size, one BlockStored per
chunk with one hash per engine block (what an engine reporting its own blocks would
send), applied without a splitter to a second index. After every step of a random
history of LMCache stores (whole prompts, extensions of a stored prefix, short last
chunks) and evictions, both indexes match every prompt alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.connectors.sink import IndexSink
from quillcache.events import encode as enc
from quillcache.events import lmcache as lmc
from quillcache.events.chunks import ChunkSplitter, sub_hash
from quillcache.index import create_backend
from tests.index.helpers import keys

BS = 4


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    hashes: list[int]  # one per chunk


def _chunk_hash(prompt: int, i: int) -> int:
    return (prompt + 1) * 1_000_003 + i


def _reference_stored(ev: enc.BlockStored, chunk: int) -> enc.BlockStored:
    """`ev` told at the engine's block size, each block under its own hash."""
    n = len(ev.token_ids) // BS
    parent = ev.parent_block_hash
    return enc.BlockStored(
        block_hashes=[int(ev.block_hashes[0]) * 64 + j for j in range(n)],
        parent_block_hash=None if parent is None else int(parent) * 64 + chunk - 1,
        token_ids=list(ev.token_ids[: n * BS]),
        block_size=BS,
        medium=ev.medium,
        group_idx=None,
    )


@st.composite
def histories(draw: st.DrawFn) -> tuple[str, int, list[Prompt], list[tuple[str, int, int]]]:
    connector = draw(st.sampled_from(sorted(lmc.CONNECTORS)))
    chunk_blocks = draw(st.integers(1, 4))
    chunk = chunk_blocks * BS
    prompts = []
    shared = draw(st.lists(st.integers(0, 50), min_size=0, max_size=2 * chunk))
    for p in range(draw(st.integers(1, 3))):
        own = draw(st.lists(st.integers(0, 50), min_size=1, max_size=3 * chunk))
        tokens = shared + own if draw(st.booleans()) else own
        n = -(-len(tokens) // chunk)
        prompts.append(Prompt(tokens, [_chunk_hash(p, i) for i in range(n)]))
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["store", "extend", "evict"]),
                st.integers(0, len(prompts) - 1),
                st.integers(0, 3),
            ),
            min_size=1,
            max_size=8,
        )
    )
    return connector, chunk, prompts, steps


@settings(max_examples=300, deadline=None)
@given(histories())
def test_split_chunks_match_as_engine_blocks_would(
    history: tuple[str, int, list[Prompt], list[tuple[str, int, int]]],
) -> None:
    connector, chunk, prompts, steps = history
    wire = lmc.wire_of(connector)
    chunk_blocks = chunk // BS
    split_index, ref_index = create_backend("memory"), create_backend("memory")
    sink = IndexSink(split_index, block_size=BS)
    for index in (split_index, ref_index):
        index.register_source(1, model="m", tokenizer="")
    stored: dict[int, int] = {}  # prompt -> chunks LMCache holds (a prefix of them)
    for step, (action, p, arg) in enumerate(steps):
        prompt = prompts[p]
        events: list[enc.Event] = []
        if action in ("store", "extend"):
            start = stored.get(p, 0) if action == "extend" else 0
            if start * chunk >= len(prompt.tokens):
                continue
            parent = prompt.hashes[start - 1] if start else None
            events = list(
                lmc.stored_chunks(
                    wire, prompt.tokens[start * chunk :], prompt.hashes[start:], chunk, parent
                )
            )
            stored[p] = max(stored.get(p, 0), start + len(events))
        else:
            held = stored.get(p, 0)
            gone = prompt.hashes[min(arg, held) : held]
            events = list(lmc.removed_chunks(wire, gone))
            if events:
                stored[p] = min(arg, held)
        if not events:
            continue
        reference: list[enc.Event] = []
        for ev in events:
            if isinstance(ev, enc.BlockStored):
                reference.append(_reference_stored(ev, chunk_blocks))
            else:
                reference.append(
                    enc.BlockRemoved(
                        block_hashes=[int(h) * 64 + j for h in ev.block_hashes for j in range(8)],
                        medium=ev.medium,
                        group_idx=None,
                    )
                )
        sink.ingest(1, [enc.encode_batch(events, ts=float(step))])
        ref_index.apply(1, [enc.encode_batch(reference, ts=float(step))])
        for other in prompts:
            request = keys(other.tokens, model="m", block_size=BS)
            assert split_index.match(request) == ref_index.match(request), (step, other)


def test_a_batch_without_chunks_is_returned_as_it_came() -> None:
    splitter = ChunkSplitter(BS)
    gpu = enc.BlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=list(range(2 * BS)), block_size=BS
    )
    payload = enc.encode_batch([gpu, enc.BlockRemoved(block_hashes=[1])], ts=0.0)
    assert splitter.split(1, payload) is payload
    assert splitter.stats.split_chunks == 0


def test_chunks_off_the_block_boundaries_are_passed_as_they_came() -> None:
    """Chunks of 6 tokens with 4-token blocks: the first looks like a short last chunk
    (its one whole block is kept), the next one, chained after it, would be off the
    engine's block boundaries: passed as it came, counted, and matching nothing at the
    engine's size beyond the first block (never a false hit)."""
    index = create_backend("memory")
    sink = IndexSink(index, block_size=BS)
    index.register_source(1, model="m", tokenizer="")
    tokens = list(range(12))
    events = lmc.stored_chunks(lmc.wire_of("mp"), tokens, [7, 8], 6)
    sink.ingest(1, [enc.encode_batch(events, ts=0.0)])
    assert sink.split_stats().misaligned_chunks == 1
    assert sink.split_stats().dropped_tokens == 2
    (match,) = index.match(keys(tokens, model="m", block_size=BS))
    assert match.blocks == 1
    assert not index.match(keys(tokens[4:], model="m", block_size=BS))


def test_sub_hashes_are_distinct_per_chunk_and_position() -> None:
    seen = {sub_hash(h, i) for h in (0, 1, 2**63, 2**64 - 1, -1) for i in range(64)}
    assert len(seen) == 4 * 64  # -1 and 2**64 - 1 are one engine hash
    with pytest.raises(ValueError, match="block_size"):
        ChunkSplitter(0)
