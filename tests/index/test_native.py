"""NativeIndex beyond the protocol: snapshots, match_many, threads, invariants."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.errors import EventDecodeError, QuillCacheError
from quillcache.events import encode as enc
from quillcache.index.inputs import InvalidIndexInputError
from quillcache.index.native import NativeIndex
from quillcache.index.types import ApplyStats, Match
from tests.index.helpers import keys, payload, removed, stored, toks


def populated() -> NativeIndex:
    idx = NativeIndex()
    idx.register_source(1, model="m", tokenizer="t")
    for w in range(1, 4):
        t = toks(6, base=w % 2)
        idx.apply(w, [payload(stored([1, 2, 3], t[:12])), payload(stored([4, 5, 6], t[12:], 3))])
        idx.apply(w, [payload(stored([1, 2], [], medium="CPU"), dp_rank=None)])
    idx.pin(keys(toks(2, base=77)))
    return idx


def test_snapshot_roundtrip_is_state_equal() -> None:
    idx = populated()
    back = NativeIndex.from_snapshot(idx.snapshot())
    assert back.state_eq(idx)
    assert back.scan(np.array([], dtype=np.uint64)) == idx.scan(np.array([], dtype=np.uint64))
    assert back.stats().resident_pairs == idx.stats().resident_pairs
    # The restored index keeps working: the engine-hash maps came along.
    back.apply(2, [payload(removed([6, 5, 4, 3, 2, 1]), removed([1, 2], medium="CPU"))])
    assert not back.state_eq(idx)
    assert back.match(keys(toks(6, base=0))) == [
        m for m in idx.match(keys(toks(6))) if m.worker != 2
    ]


def test_state_eq_sees_refcounts() -> None:
    a, b = populated(), populated()
    assert a.state_eq(b)
    b.apply(1, [payload(stored([1], toks(1, base=1)))])  # a duplicate store: refcount 2
    assert not a.state_eq(b)


@pytest.mark.parametrize("cut", [0, 7, 100, -1])
def test_corrupt_snapshots_raise(cut: int) -> None:
    data = bytearray(populated().snapshot())
    data[cut] ^= 0x01
    with pytest.raises(QuillCacheError):
        NativeIndex.from_snapshot(bytes(data))
    with pytest.raises(QuillCacheError):
        NativeIndex.from_snapshot(bytes(data[: len(data) // 2]))


def test_match_many_equals_match() -> None:
    idx = populated()
    reqs = [keys(toks(6, base=b)) for b in (0, 1, 5)] + [keys(toks(1, base=77))]
    assert idx.match_many(reqs) == [idx.match(r) for r in reqs]


def test_match_accepts_other_integer_inputs() -> None:
    idx = populated()
    k = keys(toks(6))
    expected = idx.match(k)
    assert idx.match([int(x) for x in k]) == expected
    assert idx.match(k[::-1][::-1].copy()) == expected
    strided = np.repeat(k, 2)[::2]
    assert not strided.flags.c_contiguous
    assert idx.match(strided) == expected


def test_concurrent_ingest_and_match() -> None:
    """Threads applying and matching at once never error and leave a consistent index."""
    idx = NativeIndex()
    t = toks(4)
    k = keys(t)
    errors: list[BaseException] = []

    def writer(worker: int) -> None:
        try:
            for _ in range(200):
                idx.apply(worker, [payload(stored([1, 2, 3, 4], t))])
                idx.apply(worker, [payload(removed([4, 3, 2, 1]))])
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(2000):
                for m in idx.match(k):
                    assert m.blocks in (1, 2, 3, 4)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert errors == []
    assert idx.stats().resident_pairs == 0
    idx._inner.check_invariants()


def test_old_two_element_batches_use_the_argument_rank() -> None:
    idx = NativeIndex()
    idx.apply(5, [enc.encode_batch([stored([1], toks(1))], ts=0.0, dp_rank=None)], dp_rank=7)
    assert [(m.worker, m.dp_rank) for m in idx.match(keys(toks(1)))] == [(5, 7)]


def test_apply_takes_any_sequence_of_bytes_like_payloads() -> None:
    t = toks(6)
    raw = [payload(stored([1, 2, 3], t[:12])), payload(stored([4, 5, 6], t[12:], 3))]
    want = NativeIndex()
    want_stats = want.apply(1, raw)
    assert want_stats.blocks_stored == 6
    # bytearray / memoryview items take the converting path; a tuple goes straight in.
    for payloads in (tuple(raw), [bytearray(raw[0]), memoryview(raw[1])]):
        idx = NativeIndex()
        assert idx.apply(1, payloads) == want_stats
        assert idx.state_eq(want)


@pytest.mark.parametrize("payloads", ["not a list of bytes", [b"\x90", None], 5])
def test_apply_rejects_payloads_that_are_not_bytes_like(payloads: object) -> None:
    idx = NativeIndex()
    with pytest.raises(InvalidIndexInputError, match="bytes-like"):
        idx.apply(1, payloads)  # type: ignore[arg-type]
    assert idx.stats().blocks == 0


def test_reserve_is_only_a_capacity_hint() -> None:
    hinted = NativeIndex()
    before = hinted.stats().memory_bytes
    hinted.reserve(10_000)
    assert hinted.stats().memory_bytes >= before + 10_000 * 40
    t = toks(6)
    batch = [payload(stored([1, 2, 3], t[:12])), payload(stored([4, 5, 6], t[12:], 3))]
    plain = NativeIndex()
    assert hinted.apply(1, batch) == plain.apply(1, batch)
    assert hinted.state_eq(plain)
    assert hinted.match(keys(t)) == plain.match(keys(t))
    hinted.reserve(0)  # smaller than what is there: nothing to do


@pytest.mark.parametrize("blocks", [-1, (1 << 26) + 1, 1.5, "10"])
def test_reserve_rejects_bad_hints(blocks: object) -> None:
    idx = NativeIndex()
    with pytest.raises(InvalidIndexInputError, match="blocks must be an integer"):
        idx.reserve(blocks)  # type: ignore[arg-type]


_event = st.one_of(
    st.builds(
        lambda hashes, base, parent: stored(hashes, toks(len(hashes), base=base), parent),
        st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True),
        st.integers(0, 2),
        st.none() | st.integers(1, 12),
    ),
    st.builds(removed, st.lists(st.integers(1, 12), min_size=1, max_size=4)),
)
_items = st.lists(
    st.tuples(st.integers(1, 4), st.lists(st.builds(payload, _event), max_size=3)),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(items=_items)
def test_apply_many_equals_apply_item_by_item(items: list[tuple[int, list[bytes]]]) -> None:
    one_by_one, batched = NativeIndex(), NativeIndex()
    want = ApplyStats()
    for worker, payloads in items:
        want += one_by_one.apply(worker, payloads)
    assert batched.apply_many(items) == want
    assert batched.state_eq(one_by_one)


def test_apply_many_stops_at_a_bad_batch_and_says_where() -> None:
    good = payload(stored([1, 2], toks(2)))
    later = payload(stored([3], toks(1, base=1)))
    idx = NativeIndex()
    with pytest.raises(EventDecodeError, match="item 1: payload 1") as info:
        idx.apply_many([(1, [good]), (2, [good, b"\xc1 not msgpack", later]), (3, [later])])
    err = info.value
    assert (err.item_index, err.payload_index) == (1, 1)  # type: ignore[attr-defined]
    assert err.stats.blocks_stored == 4  # type: ignore[attr-defined]
    # What came before the bad batch stays applied; nothing after it is.
    assert sorted(m.worker for m in idx.match(keys(toks(2)))) == [1, 2]
    assert idx.match(keys(toks(1, base=1))) == []


@pytest.mark.parametrize(
    "items", [[(1, [b"\x90"]), ("w", [b"\x90"])], [(1, [b"\x90"]), (2, None)], [(1,)], [5]]
)
def test_apply_many_rejects_malformed_items_before_applying_any(items: object) -> None:
    idx = NativeIndex()
    with pytest.raises(InvalidIndexInputError, match="item"):
        idx.apply_many(items)  # type: ignore[arg-type]
    assert idx.stats().blocks == 0


@pytest.mark.parametrize("bad_item", [None, 0, 211, 299])
def test_a_large_apply_many_runs_the_decoding_thread_and_equals_apply(
    bad_item: int | None,
) -> None:
    """Over 64 KiB of payloads: decoded on a second thread, windows spanning items."""
    items = []
    for i in range(300):
        t = toks(8, base=i % 7)
        hashes = [1000 * i + j for j in range(8)]
        first = payload(stored(hashes[:4], t[:64]))
        second = payload(stored(hashes[4:], t[64:], hashes[3]), removed(hashes[:1]))
        items.append((i % 5, [first, second]))
    assert sum(len(p) for _, ps in items for p in ps) > 64 * 1024
    if bad_item is not None:
        items[bad_item][1][1] = b"\xc1 not msgpack"
    one_by_one, batched = NativeIndex(), NativeIndex()
    want = ApplyStats()
    for worker, payloads in items[:bad_item]:
        want += one_by_one.apply(worker, payloads)
    if bad_item is None:
        assert batched.apply_many(items) == want
    else:
        want += one_by_one.apply(items[bad_item][0], items[bad_item][1][:1])
        with pytest.raises(EventDecodeError) as info:
            batched.apply_many(items)
        assert info.value.item_index == bad_item  # type: ignore[attr-defined]
        assert info.value.payload_index == 1  # type: ignore[attr-defined]
        assert info.value.stats == want  # type: ignore[attr-defined]
    assert batched.state_eq(one_by_one)


def chain_on_workers(workers: range, n_blocks: int) -> tuple[NativeIndex, np.ndarray]:
    """One chain of `n_blocks` stored by every worker in `workers`: a match of its
    first k keys hits every worker with k blocks."""
    idx, t = NativeIndex(), toks(n_blocks)
    pl = payload(stored(list(range(1, n_blocks + 1)), t))
    idx.apply_many([(w, [pl]) for w in workers])
    return idx, keys(t)


def test_matches_stay_right_past_the_binding_cache_bound() -> None:
    """72,000 distinct (worker, length) hits, more than the binding keeps (1 << 16
    shared Match objects): every result is still right after the cache is cleared."""
    workers, n_blocks = range(1000, 1240), 300
    idx, full = chain_on_workers(workers, n_blocks)
    for _ in range(2):  # the second round hits what the first one left cached
        for k in range(1, n_blocks + 1):
            assert idx.match(full[:k]) == [Match(w, 0, "GPU", k) for w in workers]


_THREADED_MATCHES = """
import sys, threading
from quillcache.index.types import Match
from tests.index.test_native import chain_on_workers

workers, n_blocks = range(5000, 5064), 200
idx, full = chain_on_workers(workers, n_blocks)
wrong = []

def matcher(lengths):
    for k in lengths:
        if idx.match(full[:k]) != [Match(w, 0, "GPU", k) for w in workers]:
            wrong.append(k)

sys.setswitchinterval(1e-6)
threads = [threading.Thread(target=matcher, args=(range(i, n_blocks + 1, 4),)) for i in range(1, 5)]
for th in threads:
    th.start()
for th in threads:
    th.join()
print("wrong", wrong)
"""


def test_threads_building_new_match_objects_neither_hang_nor_mix_up() -> None:
    """Every match here misses the binding's cache, so it runs Python code (building
    a Match) while other threads want the same cache; with the GIL switching every
    microsecond, holding the cache's lock across that call would deadlock with the
    GIL held, so the scenario runs in a child process the test can kill."""
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _THREADED_MATCHES],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "wrong []"
