"""KV-cache groups (hybrid models): events shaped as vLLM 0.34 publishes them for a
model with a full-attention and a sliding-window group, folded by the ingest sinks
(`quillcache.events.groups`) into residency where a block counts only where every
announced group holds it (docs/kv-events.md, "KV-cache groups")."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.connectors.sink import ControlPlaneSink, IndexSink
from quillcache.controlplane import ControlPlane
from quillcache.errors import EventDecodeError
from quillcache.events import encode as enc
from quillcache.events.groups import MAX_GROUPS_PER_SOURCE, GroupFolder, may_name_group
from quillcache.events.types import ExtraKey
from quillcache.hashing.reference import content_keys, namespace_id
from quillcache.index import IndexBackend, create_backend

BS = 4
WINDOW = 8  # tokens of the sliding window: vLLM needs cdiv(8 - 1, 4) = 2 blocks at a hit
BACKENDS = ["native", "memory"]
FULL, SWA = 0, 1
TOKENS = list(range(1000, 1000 + 6 * BS))  # 6 blocks
# vLLM hashes a block once (request.block_hashes); groups of one block size publish
# the same values, so every group's events carry these same ints.
HASHES = [0xA1 << 56 | i for i in range(1, 7)]


def _keys(tokens: Sequence[int]) -> np.ndarray:
    return np.array(content_keys(list(tokens), BS, namespace_id(block_size=BS)), np.uint64)


KEYS = _keys(TOKENS)


def vllm_stored(
    group: int,
    first: int,
    last: int,
    *,
    tokens: Sequence[int] = TOKENS,
    hashes: Sequence[int] = HASHES,
    mask: Sequence[bool] | None = None,
) -> enc.BlockStored:
    """One BlockStored as vLLM 0.34's `BlockPool.cache_full_blocks` builds it for blocks
    [first, last) of a request in `group` and `KVCacheManager.take_events` annotates it:
    the tokens of the whole range, the hashes of the blocks not masked out, the parent
    the hash of block first - 1, the group's spec kind and window."""
    keep = [i for i in range(first, last) if mask is None or mask[i - first]]
    return enc.BlockStored(
        block_hashes=[hashes[i] for i in keep],
        parent_block_hash=None if first == 0 else hashes[first - 1],
        token_ids=list(tokens[first * BS : last * BS]),
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=None,
        group_idx=group,
        kv_cache_spec_kind="full_attention" if group == FULL else "sliding_window",
        kv_cache_spec_sliding_window=None if group == FULL else WINDOW,
    )


def vllm_removed(group: int, h: int) -> enc.BlockRemoved:
    """`BlockPool._emit_block_removed_events`: one hash per event, with its group."""
    return enc.BlockRemoved(block_hashes=[h], medium="GPU", group_idx=group)


def batch(*events: enc.Event) -> bytes:
    return enc.encode_batch(list(events), ts=1.0, dp_rank=0)


def hit(index: IndexBackend, keys: np.ndarray = KEYS, worker: int = 1) -> int:
    return max((m.blocks for m in index.match(keys) if m.worker == worker), default=0)


@pytest.fixture(params=BACKENDS)
def sink(request: pytest.FixtureRequest) -> IndexSink:
    index = create_backend(request.param)
    index.register_source(1)
    return IndexSink(index)


# --- single-group engines: untouched ---------------------------------------------------


@pytest.mark.parametrize("group", [None, 0])
@pytest.mark.parametrize("positional", [False, True])
def test_single_group_payloads_reach_the_index_as_they_came(
    group: int | None, positional: bool
) -> None:
    ev = enc.BlockStored(HASHES[:2], None, TOKENS[: 2 * BS], BS, group_idx=group)
    payload = enc.encode_batch(
        [ev, enc.BlockRemoved([HASHES[1]], group_idx=group), enc.AllBlocksCleared()],
        ts=1.0,
        dp_rank=0,
        positional=positional,
    )
    folder = GroupFolder()
    assert folder.fold(1, payload) is payload
    assert not folder.grouped(1)


def test_byte_scan_finds_every_group_the_decoder_finds() -> None:
    one: list[enc.Event] = [vllm_stored(SWA, 0, 2), vllm_removed(SWA, HASHES[0])]
    for ev in one:
        for positional in (False, True):
            assert may_name_group(enc.encode_batch([ev], 1.0, 0, positional=positional))
            assert may_name_group(enc.encode_batch([ev], 1.0, None, positional=positional))
    zero: list[enc.Event] = [
        vllm_stored(FULL, 0, 2),
        vllm_removed(FULL, HASHES[0]),
        enc.AllBlocksCleared(),
    ]
    assert not may_name_group(batch(*zero))


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_group_residency_is_what_the_index_makes_of_it(backend: str) -> None:
    plain, folded = create_backend(backend), create_backend(backend)
    payloads = [
        batch(vllm_stored(FULL, 0, 4)),
        batch(vllm_removed(FULL, HASHES[2])),
        batch(vllm_stored(FULL, 2, 6)),
    ]
    assert IndexSink(folded).ingest(1, payloads) == plain.apply(1, payloads)
    assert folded.match(KEYS) == plain.match(KEYS)


# --- hybrid: full attention + sliding window --------------------------------------------


def test_both_groups_holding_a_prefix_make_it_usable(sink: IndexSink) -> None:
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4))])
    assert hit(sink.index) == 4
    assert sink.groups.grouped(1)


def test_a_removal_in_one_group_cuts_the_prefix_there(sink: IndexSink) -> None:
    payloads = [
        batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4)),
        batch(vllm_removed(SWA, HASHES[2])),
    ]
    sink.ingest(1, payloads)
    assert hit(sink.index) == 2
    # What the index makes of the same events unfolded: the hash is held twice (once
    # per group) under one content key, so one group's eviction leaves it usable.
    raw = create_backend(sink.index.name)
    raw.apply(1, payloads)
    assert hit(raw) == 4
    # The group stores it again: usable again, through to the blocks after it.
    sink.ingest(1, [batch(vllm_stored(SWA, 2, 3))])
    assert hit(sink.index) == 4


def test_a_block_one_group_lacks_is_not_usable(sink: IndexSink) -> None:
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 2))])
    assert hit(sink.index) == 2
    # The children wait for their parent; the group's store of it brings them in.
    sink.ingest(1, [batch(vllm_stored(SWA, 3, 4))])
    assert hit(sink.index) == 2
    sink.ingest(1, [batch(vllm_stored(SWA, 2, 3))])
    assert hit(sink.index) == 4


def test_a_hash_stored_twice_in_a_group_needs_two_removals(sink: IndexSink) -> None:
    both = [vllm_stored(FULL, 0, 3), vllm_stored(SWA, 0, 3)]
    sink.ingest(1, [batch(*both), batch(vllm_stored(SWA, 0, 3))])
    sink.ingest(1, [batch(vllm_removed(SWA, HASHES[1]))])
    assert hit(sink.index) == 3
    sink.ingest(1, [batch(vllm_removed(SWA, HASHES[1]))])
    assert hit(sink.index) == 1


def test_all_blocks_cleared_empties_every_group(sink: IndexSink) -> None:
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4))])
    sink.ingest(1, [batch(enc.AllBlocksCleared())])
    assert hit(sink.index) == 0
    # The groups stay announced: one group's store alone is not usable.
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4))])
    assert hit(sink.index) == 0
    sink.ingest(1, [batch(vllm_stored(SWA, 0, 4))])
    assert hit(sink.index) == 4


def test_an_engine_restart_forgets_the_groups(sink: IndexSink) -> None:
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4))])
    sink.clear_source(1)
    assert hit(sink.index) == 0 and not sink.groups.grouped(1)
    # Restarted with a single-group model: its events pass through as they came.
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4))])
    assert hit(sink.index) == 4 and not sink.groups.grouped(1)


def test_going_grouped_drops_what_was_applied_before(sink: IndexSink) -> None:
    # Group-0 residency applied before the first event of another group was counted
    # without that group: dropped, never kept as a hit the engine may not give.
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4))])
    assert hit(sink.index) == 4
    sink.ingest(1, [batch(vllm_stored(SWA, 0, 4))])
    assert hit(sink.index) == 0
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4))])
    assert hit(sink.index) == 4


def test_a_masked_sparse_store_places_none_of_its_blocks(sink: IndexSink) -> None:
    # vLLM 0.34 skips a sparse group's masked blocks (`reachable_block_mask`) but sends
    # the tokens of the whole range: which hash is which block is not said.
    mask = [False, True, False, True]
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4, mask=mask))])
    assert hit(sink.index) == 0
    assert sink.groups.stats.unplaced_blocks == 2


def test_the_swa_rule_is_conservative(sink: IndexSink) -> None:
    # The sliding-window group evicted the first blocks and keeps the last window:
    # vLLM would hit all 6 blocks (full attention holds them, the window is there);
    # the folded residency says 0: a missed hit, never a false one.
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 6), vllm_stored(SWA, 0, 6))])
    sink.ingest(1, [batch(*(vllm_removed(SWA, h) for h in HASHES[:4]))])
    assert hit(sink.index) == 0
    assert vllm_hit({FULL: set(HASHES), SWA: set(HASHES[4:])}, HASHES) == 6


def test_other_media_fold_by_themselves(sink: IndexSink) -> None:
    cpu = [
        enc.BlockStored(HASHES[:3], None, [], BS, medium="CPU", group_idx=g) for g in (FULL, SWA)
    ]
    sink.ingest(1, [batch(vllm_stored(FULL, 0, 3), vllm_stored(SWA, 0, 3), *cpu)])
    sink.ingest(1, [batch(vllm_removed(SWA, HASHES[0]))])
    by_medium = {m.medium: m.blocks for m in sink.index.match(KEYS)}
    assert by_medium == {"CPU": 3}


def test_too_many_groups_are_refused_and_the_batches_before_applied(sink: IndexSink) -> None:
    good = batch(vllm_stored(FULL, 0, 2), vllm_stored(SWA, 0, 2))
    many = batch(
        *(
            enc.BlockStored(HASHES[:1], None, TOKENS[:BS], BS, group_idx=g)
            for g in range(MAX_GROUPS_PER_SOURCE + 1)
        )
    )
    with pytest.raises(EventDecodeError, match="MAX_GROUPS_PER_SOURCE") as err:
        sink.ingest(1, [good, many], seqs=[5, 6])
    assert err.value.payload_index == 1
    assert err.value.stats.blocks_stored > 0
    assert hit(sink.index) == 2
    assert sink.groups.stats.refused_batches == 1


def test_the_batch_rank_names_the_source() -> None:
    index = create_backend("native")
    sink = IndexSink(index)
    ranked = enc.encode_batch([vllm_stored(FULL, 0, 2), vllm_stored(SWA, 0, 2)], 1.0, 3)
    sink.ingest(1, [ranked])
    assert sink.groups.grouped(1, 3) and not sink.groups.grouped(1, 0)
    assert {(m.dp_rank, m.blocks) for m in index.match(KEYS)} == {(3, 2)}


def test_a_worker_added_again_starts_from_nothing() -> None:
    plane = ControlPlane(index="native", router="quillcache-greedy", block_size=BS)
    try:
        plane.add_worker(1, capacity_blocks=100)
        sink = ControlPlaneSink(plane)
        sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 4))])
        assert hit(plane.index) == 4
        plane.remove_worker(1)
        plane.add_worker(1, capacity_blocks=100)
        # The folder's view of the old registration would say the sliding-window group
        # holds these; the new one has announced nothing yet.
        sink.ingest(1, [batch(vllm_stored(FULL, 0, 4), vllm_stored(SWA, 0, 2))])
        assert hit(plane.index) == 2
    finally:
        plane.close()


# --- against a reference: per-group sets, and vLLM's own rule ---------------------------

# Two request paths sharing their first two blocks; every block's hash is its path
# position, as vLLM's chained hashes would be.
PATHS = [list(range(1000, 1000 + 5 * BS)), list(range(1000, 1000 + 2 * BS)) + [7] * (3 * BS)]
PATH_HASHES = [[p * 100 + i + 1 if i >= 2 else i + 1 for i in range(5)] for p in range(2)]
PATH_KEYS = [_keys(t) for t in PATHS]


def vllm_hit(held: dict[int, set[int]], hashes: Sequence[int]) -> int:
    """vLLM 0.34's hit for a full-attention group 0 and a sliding-window group 1
    (`HybridKVCacheCoordinator.find_longest_cache_hit`, one pass for a simple hybrid:
    full attention's left-to-right run, then `SlidingWindowManager`'s right-to-left
    search for `cdiv(window - 1, block_size)` contiguous blocks within it)."""
    full = 0
    while full < len(hashes) and hashes[full] in held.get(FULL, set()):
        full += 1
    if SWA not in held:
        return full
    need = -(-(WINDOW - 1) // BS)
    run = 0
    for i in range(full - 1, -1, -1):
        if hashes[i] in held[SWA]:
            run += 1
            if run >= need:
                return i + run
        else:
            run = 0
    return run


op = st.one_of(
    st.tuples(
        st.just("store"),
        st.sampled_from([FULL, SWA]),
        st.integers(0, 1),
        st.integers(0, 4),
        st.integers(1, 5),
    ),
    st.tuples(
        st.just("remove"), st.sampled_from([FULL, SWA]), st.integers(0, 1), st.integers(0, 4)
    ),
    st.tuples(st.just("clear")),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, max_size=25), backend=st.sampled_from(BACKENDS))
def test_folded_residency_is_the_longest_prefix_every_group_holds(
    ops: list[tuple[str, ...] | tuple[str, int, int, int] | tuple[str, int, int, int, int]],
    backend: str,
) -> None:
    index = create_backend(backend)
    sink = IndexSink(index)
    held: dict[int, Counter[int]] = {FULL: Counter(), SWA: Counter()}
    # Each group announced first, as a hybrid engine's first step does.
    sink.ingest(1, [batch(enc.BlockStored([99], None, [5] * BS, BS, group_idx=g)) for g in (0, 1)])
    for g in (0, 1):
        held[g][99] += 1
    for o in ops:
        ev: enc.Event
        if o[0] == "store":
            g, p, first, n = (int(x) for x in o[1:])
            last = min(5, first + n)
            ev = vllm_stored(g, first, last, tokens=PATHS[p], hashes=PATH_HASHES[p])
            for h in ev.block_hashes:
                held[g][int(h)] += 1
        elif o[0] == "remove":
            g, p, k = (int(x) for x in o[1:])
            h = PATH_HASHES[p][k]
            ev = vllm_removed(g, h)
            if held[g][h]:
                held[g][h] -= 1
        else:
            ev = enc.AllBlocksCleared()
            held = {FULL: Counter(), SWA: Counter()}
        sink.ingest(1, [batch(ev)])
        for keys, hashes in zip(PATH_KEYS, PATH_HASHES, strict=True):
            sets = {g: {h for h, c in held[g].items() if c > 0} for g in held}
            ref = 0
            while ref < 5 and all(hashes[ref] in s for s in sets.values()):
                ref += 1
            got = hit(index, keys)
            assert got == ref
            assert got <= vllm_hit(sets, hashes)  # never a hit vLLM would not give


@pytest.mark.parametrize("backend", BACKENDS)
def test_folding_keeps_every_blocks_content_key(backend: str) -> None:
    # LoRA name, the salt in block 0's extra keys, a multimodal item in block 1: the
    # namespace and the keys the index derives from them are those of the same blocks
    # published by a single-group engine.
    extra: list[Sequence[ExtraKey] | None] = [
        ["my-lora", "salt"],
        ["my-lora", enc.MmKey("img", 2)],
        ["my-lora"],
    ]

    def ev(group: int | None) -> enc.BlockStored:
        return enc.BlockStored(
            HASHES[:3],
            None,
            TOKENS[: 3 * BS],
            BS,
            lora_name="my-lora",
            extra_keys=extra,
            group_idx=group,
        )

    plain, folded = create_backend(backend), create_backend(backend)
    plain.apply(1, [batch(ev(None))])
    IndexSink(folded).ingest(1, [batch(ev(FULL), ev(SWA))])
    assert sorted(e.key for e in folded.entries()) == sorted(e.key for e in plain.entries())
    assert len(list(folded.entries())) == 3
