"""The conformance suite: every registered index backend, the same expectations.

A backend registered by name (built-in or entry point) is picked up automatically.
The rules tested here are those of docs/index.md.
"""

from __future__ import annotations

import numpy as np
import pytest

from quillcache.errors import EventDecodeError, QuillCacheError
from quillcache.events import encode as enc
from quillcache.hashing.reference import block_key, namespace_id
from quillcache.index import IndexBackend, Match
from tests.events.golden import FRAMES
from tests.index.helpers import backends, keys, make, payload, removed, stored, toks


@pytest.fixture(params=backends())
def index(request: pytest.FixtureRequest) -> IndexBackend:
    backend = make(request.param)
    yield backend
    backend.close()


def blocks_of(matches: list[Match]) -> dict[tuple[int, int, str], int]:
    return {(m.worker, m.dp_rank, m.medium): m.blocks for m in matches}


def test_store_match_remove(index: IndexBackend) -> None:
    t = toks(3)
    s = index.apply(1, [payload(stored([11, 12, 13], t))])
    assert (s.batches, s.events, s.blocks_stored) == (1, 1, 3)
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 3)]
    assert index.match(keys(t)[:2]) == [Match(1, 0, "GPU", 2)]
    assert index.match(keys(toks(3, base=100))) == []
    s = index.apply(1, [payload(removed([12]))])
    assert s.blocks_removed == 1
    # Block 1 is gone: the run from block 0 stops there even though block 2 is held.
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 1)]


def test_golden_frames_apply(index: IndexBackend) -> None:
    payloads = [p for _, p, _ in FRAMES]
    s = index.apply(7, payloads[:1])
    assert s.blocks_stored == 2
    assert index.match(keys([1, 2, 3, 4, 5, 6, 7, 8])) == [Match(7, 0, "GPU", 2)]
    s = index.apply(7, payloads[1:2])
    assert (s.blocks_removed, s.clears) == (1, 1)
    assert index.stats().resident_pairs == 0


def test_parent_chaining_and_multi_worker(index: IndexBackend) -> None:
    t = toks(4)
    index.apply(1, [payload(stored([1, 2], t[:8])), payload(stored([3, 4], t[8:], parent=2))])
    index.apply(2, [payload(stored([91, 92], t[:8]))])
    assert blocks_of(index.match(keys(t))) == {(1, 0, "GPU"): 4, (2, 0, "GPU"): 2}
    assert [m.worker for m in index.match(keys(t))] == [1, 2]


def test_duplicate_stores_are_refcounted(index: IndexBackend) -> None:
    t = toks(1)
    index.apply(1, [payload(stored([5], t)), payload(stored([5], t))])
    (entry,) = index.scan(np.array([], dtype=np.uint64))
    assert entry.holders[0].refcount == 2
    index.apply(1, [payload(removed([5]))])
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 1)]
    index.apply(1, [payload(removed([5]))])
    assert index.match(keys(t)) == []
    s = index.apply(1, [payload(removed([5]))])
    assert s.unknown_removals == 1


def test_unknown_parent_is_orphan(index: IndexBackend) -> None:
    s = index.apply(1, [payload(stored([2, 3], toks(2), parent=999))])
    assert (s.orphan_blocks, s.blocks_stored) == (2, 0)
    assert index.stats().blocks == 0


def test_tokenless_store_resolves_known_hashes(index: IndexBackend) -> None:
    t = toks(2)
    index.apply(1, [payload(stored([1, 2], t))])
    s = index.apply(1, [payload(stored([1, 2, 77], [], medium="CPU"))])
    assert (s.blocks_stored, s.orphan_blocks) == (2, 1)
    assert blocks_of(index.match(keys(t))) == {(1, 0, "CPU"): 2, (1, 0, "GPU"): 2}
    # Another source does not share this source's engine hashes.
    s = index.apply(2, [payload(stored([1, 2], [], medium="CPU"))])
    assert s.orphan_blocks == 2
    # GPU eviction leaves the CPU copy, which is still removable by hash.
    index.apply(1, [payload(removed([1, 2]))])
    assert index.match(keys(t)) == [Match(1, 0, "CPU", 2)]
    s = index.apply(1, [payload(removed([1, 2], medium="CPU"))])
    assert s.blocks_removed == 2
    assert index.stats().blocks == 0


def test_too_few_tokens_is_invalid(index: IndexBackend) -> None:
    s = index.apply(1, [payload(stored([1, 2], toks(1)))])
    assert (s.invalid_events, s.blocks_stored) == (1, 0)


def test_extra_tokens_are_ignored(index: IndexBackend) -> None:
    t = toks(3)
    index.apply(1, [payload(stored([1, 2], t))])  # hybrid models may send more tokens
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 2)]


def test_media_are_normalised(index: IndexBackend) -> None:
    t = toks(1)
    index.apply(1, [payload(stored([1], t, medium="cpu_pinned"))])
    index.apply(2, [payload(stored([1], t, medium=None))])
    index.apply(3, [payload(stored([1], t, medium="nvme-tier"))])
    assert [m.medium for m in index.match(keys(t))] == ["CPU", "GPU", "nvme-tier"]
    cols = index.match_columns(keys(t))
    assert (cols.worker.tolist(), cols.medium.tolist(), cols.blocks.tolist()) == (
        [1, 2, 3],
        [1, 0, 3],
        [1, 1, 1],
    )
    assert cols.other_media == ("nvme-tier",)


def test_batch_dp_rank_wins_over_argument(index: IndexBackend) -> None:
    t = toks(1)
    index.apply(1, [payload(stored([1], t), dp_rank=3)], dp_rank=0)
    index.apply(1, [payload(stored([1], t), dp_rank=None)], dp_rank=2)
    assert blocks_of(index.match(keys(t))) == {(1, 3, "GPU"): 1, (1, 2, "GPU"): 1}
    assert index.clear_source(1, 3) == 1
    assert index.match(keys(t)) == [Match(1, 2, "GPU", 1)]


def test_matches_sorted_by_worker_rank_medium(index: IndexBackend) -> None:
    t = toks(1)
    for worker, rank, medium in [(3, 0, "GPU"), (1, 1, "GPU"), (1, 0, "GPU"), (1, 0, "CPU")]:
        index.apply(worker, [payload(stored([1], t, medium=medium), dp_rank=rank)])
    got = [(m.worker, m.dp_rank, m.medium) for m in index.match(keys(t))]
    assert got == sorted(got)
    assert len(got) == 4


def test_clear_and_remove_worker(index: IndexBackend) -> None:
    t = toks(2)
    for w in (1, 2):
        for rank in (0, 1):
            index.apply(w, [payload(stored([1, 2], t), dp_rank=rank)])
    assert index.stats().resident_pairs == 8
    s = index.apply(1, [payload(enc.AllBlocksCleared(), dp_rank=1)])
    assert s.clears == 1
    assert index.stats().resident_pairs == 6
    assert index.remove_worker(2) == 4
    assert index.stats().sources == 2  # worker 1's ranks; a cleared source stays known
    assert blocks_of(index.match(keys(t))) == {(1, 0, "GPU"): 2}
    # After a clear the hashes are forgotten: removing them is "unknown".
    assert index.apply(1, [payload(removed([1]), dp_rank=1)]).unknown_removals == 1


def test_clear_medium_drops_one_tier_of_one_source(index: IndexBackend) -> None:
    """LMCache's /clear of an engine's CPU tier: its CPU copies go, its GPU copies and
    another engine's CPU copies stay, and the cleared hashes are forgotten."""
    t = toks(2)
    index.apply(1, [payload(stored([1, 2], t), stored([1, 2], t, medium="cpu"))])
    index.apply(2, [payload(stored([1, 2], t, medium="CPU"))])
    assert index.clear_medium(1, 0, "cpu") == 2
    assert blocks_of(index.match(keys(t))) == {(1, 0, "GPU"): 2, (2, 0, "CPU"): 2}
    assert index.stats().resident_pairs == 4
    assert index.clear_medium(1, 0, "CPU") == 0  # nothing left there
    assert index.clear_medium(7, 0, "CPU") == 0  # an unknown source
    # the GPU copy still maps the hashes: the engine's later removal is known
    assert index.apply(1, [payload(removed([1, 2]))]).blocks_removed == 2
    assert index.clear_medium(2, 0, "CPU") == 2
    assert index.stats().blocks == 0
    assert index.apply(2, [payload(removed([1], medium="CPU"))]).unknown_removals == 1
    for bad in ("", 7, None):
        with pytest.raises(QuillCacheError):
            index.clear_medium(1, 0, bad)  # type: ignore[arg-type]


def test_everything_removed_leaves_nothing(index: IndexBackend) -> None:
    for w in range(3):
        t = toks(5, base=w % 2)
        index.apply(w, [payload(stored([1, 2, 3], t[:12])), payload(stored([4, 5], t[12:], 3))])
    assert index.stats().blocks > 0
    for w in range(3):
        index.apply(w, [payload(removed([5, 4, 3, 2, 1]))])
    st = index.stats()
    assert (st.blocks, st.resident_pairs) == (0, 0)
    assert st.extra.get("nodes", 0) == 0
    assert list(index.entries()) == []


def test_scan_subtree_and_parents(index: IndexBackend) -> None:
    t = toks(3)
    index.apply(1, [payload(stored([1, 2, 3], t))])
    other = t[:4] + [500 + i for i in range(8)]
    index.apply(2, [payload(stored([7, 8, 9], other))])
    k, k2 = keys(t), keys(other)
    everything = index.scan(np.array([], dtype=np.uint64))
    assert [e.key for e in everything] == sorted({*map(int, k), *map(int, k2)})
    sub = index.scan(k[:1])
    assert {e.key for e in sub} == {int(x) for x in [*k, *k2[1:]]}
    by_key = {e.key: e for e in everything}
    assert by_key[int(k[0])].parent == namespace_id(block_size=4)
    assert by_key[int(k[1])].parent == int(k[0])
    assert [by_key[int(x)].depth for x in k] == [0, 1, 2]
    assert index.scan(keys(toks(1, base=999))) == []


def test_pins(index: IndexBackend) -> None:
    t = toks(3)
    k = keys(t)
    index.pin(k[:2])
    pinned = index.scan(np.array([], dtype=np.uint64))
    assert [(e.key, e.pinned, e.holders) for e in pinned] == sorted(
        [(int(k[0]), True, ()), (int(k[1]), True, ())]
    )
    index.apply(1, [payload(stored([1, 2, 3], t))])
    index.apply(1, [payload(removed([1, 2, 3]))])
    assert {e.key for e in index.scan(k[:1])} == {int(k[0]), int(k[1])}
    index.unpin(k[:2])
    assert index.stats().blocks == 0
    index.unpin(k[:2])  # never pinned any more: a no-op
    assert index.stats().blocks == 0


def test_decode_error_keeps_earlier_batches(index: IndexBackend) -> None:
    t = toks(1)
    good = payload(stored([1], t))
    with pytest.raises(EventDecodeError) as exc:
        index.apply(1, [good, b"\x93\xc1", payload(stored([2], toks(1, base=50)))])
    assert "payload 1" in str(exc.value)
    assert exc.value.payload_index == 1
    assert exc.value.stats.blocks_stored == 1
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 1)]
    assert index.match(keys(toks(1, base=50))) == []


@pytest.mark.parametrize("bad", [[-1], [1 << 64], [1.5], np.array([[1, 2]], dtype=np.uint64)])
def test_bad_keys_raise_typed_errors(index: IndexBackend, bad: object) -> None:
    with pytest.raises(QuillCacheError):
        index.match(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("worker,rank", [(-1, 0), (1 << 64, 0), (1, -1), (1, 1 << 32)])
def test_bad_source_ids_raise_typed_errors(index: IndexBackend, worker: int, rank: int) -> None:
    with pytest.raises(QuillCacheError):
        index.apply(worker, [payload(stored([1], toks(1)))], dp_rank=rank)


def test_register_source_sets_the_namespace(index: IndexBackend) -> None:
    t = toks(2)
    index.register_source(1, model="llama", tokenizer="tok-v1")
    index.apply(1, [payload(stored([1, 2], t))])
    assert index.match(keys(t)) == []
    assert index.match(keys(t, model="llama", tokenizer="tok-v1")) == [Match(1, 0, "GPU", 2)]


def test_lora_and_salt_namespaces(index: IndexBackend) -> None:
    t = toks(1)
    vllm = stored([1], t, lora_name="sql", extra_keys=[["sql", "tenant-a"]])
    sglang = stored([1], t, cache_salt="tenant-b")
    index.apply(1, [payload(vllm)])
    index.apply(2, [payload(sglang)])
    assert index.match(keys(t, lora="sql", tenant="tenant-a")) == [Match(1, 0, "GPU", 1)]
    assert index.match(keys(t, tenant="tenant-b")) == [Match(2, 0, "GPU", 1)]
    assert index.match(keys(t)) == []


def test_mm_items_enter_the_key(index: IndexBackend) -> None:
    t = toks(2)
    index.apply(1, [payload(stored([1, 2], t, extra_keys=[None, [["img", 1]]]))])
    k0 = block_key(namespace_id(block_size=4), t[:4])
    k1 = block_key(k0, t[4:], [("img", 1)])
    assert index.match(np.array([k0, k1], dtype=np.uint64)) == [Match(1, 0, "GPU", 2)]
    assert index.match(keys(t)) == [Match(1, 0, "GPU", 1)]


# TODO(H5): native-wal raises a bare TypeError here; move into the suite once it validates.
@pytest.mark.parametrize("name", ["memory", "native"])
def test_payloads_must_be_bytes(name: str) -> None:
    index = make(name)
    with pytest.raises(QuillCacheError):
        index.apply(1, ["not bytes"])  # type: ignore[list-item]
    assert index.stats().blocks == 0


def test_engine_map_stale_alias_and_shared_hashes(index: IndexBackend) -> None:
    """Two sources share a hash; one source also stores the block under an alias hash.

    Losing the block through the alias drops only the alias mapping: the first hash
    still resolves (here: for a token-less store while another source keeps the block).
    """
    t = toks(1)
    index.apply(1, [payload(stored([11], t))])
    index.apply(2, [payload(stored([11], t))])  # same content, same hash
    index.apply(1, [payload(stored([22], t))])  # same content, another hash: refcount 2
    index.apply(1, [payload(removed([22]))])
    assert blocks_of(index.match(keys(t))) == {(1, 0, "GPU"): 1, (2, 0, "GPU"): 1}
    index.apply(1, [payload(removed([22]))])  # last copy: worker 1 holds it nowhere
    assert index.match(keys(t)) == [Match(2, 0, "GPU", 1)]
    assert index.apply(1, [payload(removed([22]))]).unknown_removals == 1
    s = index.apply(1, [payload(stored([11], [], medium="CPU"))])
    assert (s.blocks_stored, s.orphan_blocks) == (1, 0)
    assert blocks_of(index.match(keys(t))) == {(1, 0, "CPU"): 1, (2, 0, "GPU"): 1}
    # Worker 2's mapping of hash 11 is its own: removing it there leaves worker 1's.
    index.apply(2, [payload(removed([11]))])
    assert index.match(keys(t)) == [Match(1, 0, "CPU", 1)]
    assert index.apply(1, [payload(removed([11], medium="CPU"))]).blocks_removed == 1
    assert index.stats().blocks == 0


def test_engine_map_overwrite(index: IndexBackend) -> None:
    """A hash re-stored with other content now names the new block; the old block
    keeps its residency (nothing names it any more) until a clear."""
    a, b = toks(1), toks(1, base=500)
    index.apply(1, [payload(stored([7], a)), payload(stored([7], b))])
    index.apply(2, [payload(stored([7], a))])
    assert index.apply(1, [payload(removed([7]))]).blocks_removed == 1
    assert index.match(keys(b)) == []
    assert blocks_of(index.match(keys(a))) == {(1, 0, "GPU"): 1, (2, 0, "GPU"): 1}
    assert index.apply(1, [payload(removed([7]))]).unknown_removals == 1
    assert index.apply(2, [payload(removed([7]))]).blocks_removed == 1
    assert index.clear_source(1) == 1
    assert index.stats().blocks == 0
