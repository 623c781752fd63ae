"""Every backend against the MemoryIndex reference, on the same random event streams.

Streams mix several workers, dp ranks, media, namespaces (model, LoRA, salt in
extra keys or as SGLang's field, multimodal items), KV-cache groups, removes,
clears, duplicate stores, re-stores of a hash with other content, unknown parents,
token-less stores (offload tiers), pins and undecodable payloads. After every step
the two indexes must agree on the ApplyStats, on every match of every request the
stream could have produced, on scans and on the counters.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.errors import EventDecodeError
from quillcache.events import encode as enc
from quillcache.hashing.reference import block_key, namespace_id
from quillcache.index import IndexBackend, create_backend
from tests.index.helpers import BS, backends, payload, removed, stored

OTHERS = [b for b in backends() if b != "memory"]

#: Sequences of block ids; they share prefixes (0-1-2 / 0-1-5 / 0-7) and one does not.
FAMILIES = [(1, 2, 3, 4), (1, 2, 5, 6), (1, 7, 8), (9, 10)]
MODELS = ["", "m"]
LORAS = [None, "lora-a"]
SALTS = [None, "tenant-x"]
MEDIA = ["GPU", "CPU", "DISK"]
EMPTY = np.array([], dtype=np.uint64)


def block_tokens(block_id: int) -> list[int]:
    return [block_id * 100 + j for j in range(BS)]


@dataclass(frozen=True)
class Variant:
    lora: str | None
    salt: str | None
    sglang_salt: bool  # salt as the `cache_salt` field instead of in extra keys
    mm_block: int | None  # this block carries a multimodal item


def request_keys(model: str, family: tuple[int, ...], v: Variant) -> np.ndarray:
    parent = namespace_id(model, "", v.lora or "", v.salt or "", BS)
    out = []
    for i, b in enumerate(family):
        mm = [("img", 0)] if v.mm_block == i else None
        parent = block_key(parent, block_tokens(b), mm)
        out.append(parent)
    return np.array(out, dtype=np.uint64)


@dataclass
class Stream:
    """Hashes the engines use: content-derived (equal content, equal hash), as vLLM."""

    hashes: dict[tuple[object, ...], int] = field(default_factory=dict)

    def engine_hash(self, family: tuple[int, ...], upto: int, v: Variant, group: int) -> int:
        return self.hashes.setdefault((family[: upto + 1], v, group), len(self.hashes) + 1)


variants = st.builds(
    Variant,
    lora=st.sampled_from(LORAS),
    salt=st.sampled_from(SALTS),
    sglang_salt=st.booleans(),
    mm_block=st.sampled_from([None, None, 1]),
)


def store_event(data: st.DataObject, stream: Stream) -> enc.BlockStored:
    family = data.draw(st.sampled_from(FAMILIES), label="family")
    v = data.draw(variants, label="variant")
    group = data.draw(st.sampled_from([0, 0, 1]), label="group")
    start = data.draw(st.integers(0, len(family) - 1), label="start")
    end = data.draw(st.integers(start + 1, len(family)), label="end")
    medium = data.draw(st.sampled_from(MEDIA), label="medium")
    hashes = [stream.engine_hash(family, i, v, group) for i in range(start, end)]
    if data.draw(st.integers(0, 9), label="collide") == 0:
        hashes[0] = 1  # the same hash re-stored with other content
    parent = None if start == 0 else stream.engine_hash(family, start - 1, v, group)
    if start > 0 and data.draw(st.integers(0, 9), label="unknown parent") == 0:
        parent = 10_000
    tokens = [t for b in family[start:end] for t in block_tokens(b)]
    if data.draw(st.integers(0, 9), label="tokenless") == 0:
        tokens = []
    extra: list[list[object] | None] = []
    for i in range(start, end):
        items: list[object] = []
        if v.lora:
            items.append(v.lora)
        if i == 0 and v.salt and not v.sglang_salt:
            items.append(v.salt)
        if v.mm_block == i:
            items.append(["img", 0])
        extra.append(items or None)
    return stored(
        hashes,
        tokens,
        parent,
        medium=medium,
        lora_name=v.lora,
        extra_keys=extra if any(extra) else None,
        group_idx=group,
        cache_salt=v.salt if v.sglang_salt and start == 0 else None,
    )


#: Candidates by worker id: the three workers the streams use and one never seen
#: (not a source: it holds nothing, whatever a compact match's floors say).
POSITION = np.array([2, 0, 3, 1], dtype=np.intp)
RANKED_POSITION = np.array([0, 2, 3, 5], dtype=np.intp)
RANK_COUNTS = np.array([2, 2, 1, 2, 2, 1], dtype=np.intp)


def assert_same_tiers(ref: IndexBackend, other: IndexBackend, k: np.ndarray) -> None:
    """`match_tiers` (compact where the backend can: the floors stand for every live
    source) against the tiers of the reference's full match, and the compact
    columns plus floors expand to the full match."""
    tiers, cols = other.match_tiers(k, POSITION, 4)
    full = ref.match_columns(k)
    assert tiers.tolist() == full.tiers(POSITION, 4).tolist()
    floors = {cols.medium_name(code): blocks for code, blocks in cols.floors}
    above = {(m.worker, m.dp_rank, m.medium): m.blocks for m in cols.matches()}
    for m in ref.match(k):
        assert above.get((m.worker, m.dp_rank, m.medium), floors.get(m.medium)) == m.blocks
    assert all(b > floors.get(medium, 0) for (_, _, medium), b in above.items())
    # data-parallel candidates: workers 0 and 2 with two ranks, 1 and 3 with one (their
    # rank 1 is not a candidate), each rank a row of its own
    tiers, ranked = other.match_tiers(k, RANKED_POSITION, 6, RANK_COUNTS)
    if ranked.positions is not None:  # each hit placed as the plane places it
        want_at = []
        for w, r in zip(ranked.worker.tolist(), ranked.dp_rank.tolist(), strict=True):
            at = int(RANKED_POSITION[w]) if w < len(RANKED_POSITION) else -1
            want_at.append(at + r if at >= 0 and r < RANK_COUNTS[at] else -1)
        assert ranked.positions == want_at
    want = np.zeros((3, 6), dtype=np.int64)
    tier_row = {"GPU": 0, "CPU": 1}
    for m in ref.match(k):
        at = int(RANKED_POSITION[m.worker])
        if m.dp_rank >= RANK_COUNTS[at]:
            continue
        row = tier_row.get(m.medium, 2)
        want[row, at + m.dp_rank] = max(want[row, at + m.dp_rank], m.blocks)
    assert tiers.tolist() == want.tolist()


def assert_same_state(ref: IndexBackend, other: IndexBackend) -> None:
    for model in MODELS:
        for family in FAMILIES:
            for lora in LORAS:
                for salt in SALTS:
                    for mm in (None, 1):
                        k = request_keys(model, family, Variant(lora, salt, False, mm))
                        assert other.match(k) == ref.match(k), (model, family, lora, salt, mm)
                        assert other.match_columns(k).matches() == ref.match(k)
                        assert_same_tiers(ref, other, k)
                        assert other.scan(k[:1]) == ref.scan(k[:1])
    assert other.scan(EMPTY) == ref.scan(EMPTY)
    assert sorted(other.entries(), key=lambda e: e.key) == ref.scan(EMPTY)
    a, b = ref.stats(), other.stats()
    assert (a.blocks, a.resident_pairs, a.sources) == (b.blocks, b.resident_pairs, b.sources)
    assert a.extra["nodes"] == b.extra["nodes"]


def step(data: st.DataObject, stream: Stream, pair: tuple[IndexBackend, IndexBackend]) -> None:
    kind = data.draw(
        st.sampled_from(
            ["store"] * 6
            + ["remove"] * 4
            + ["clear", "clear medium", "drop", "pin", "unpin", "bad"]
        ),
        label="op",
    )
    worker = data.draw(st.integers(0, 2), label="worker")
    rank = data.draw(st.integers(0, 1), label="rank")
    if kind in ("store", "remove", "bad"):
        events: list[enc.Event] = []
        for _ in range(data.draw(st.integers(1, 3), label="events")):
            if kind == "remove" or data.draw(st.integers(0, 5), label="mix") == 0:
                h = data.draw(st.integers(1, len(stream.hashes) + 2), label="hash")
                group = data.draw(st.sampled_from([0, 0, 1]), label="rgroup")
                medium = data.draw(st.sampled_from(MEDIA), label="rmedium")
                events.append(removed([h], medium=medium, group_idx=group))
            else:
                events.append(store_event(data, stream))
        payloads = [payload(*events, dp_rank=data.draw(st.sampled_from([rank, None])))]
        if kind == "bad":
            payloads.append(b"\x92\xcb")  # truncated
            payloads.append(payload(store_event(data, stream)))
        results = []
        for idx in pair:
            try:
                results.append(idx.apply(worker, payloads, dp_rank=rank))
            except EventDecodeError as err:
                results.append(("error", err.payload_index, err.stats))  # type: ignore[attr-defined]
        assert results[0] == results[1]
    elif kind == "clear":
        assert pair[0].clear_source(worker, rank) == pair[1].clear_source(worker, rank)
    elif kind == "clear medium":
        # lower case as LMCache sends it: the same medium as "CPU"
        medium = data.draw(st.sampled_from([*MEDIA, "cpu"]), label="cleared medium")
        dropped = [idx.clear_medium(worker, rank, medium) for idx in pair]
        assert dropped[0] == dropped[1]
    elif kind == "drop":
        assert pair[0].remove_worker(worker) == pair[1].remove_worker(worker)
    else:
        family = data.draw(st.sampled_from(FAMILIES), label="pin family")
        n = data.draw(st.integers(1, len(family)), label="pin len")
        k = request_keys("", family, Variant(None, None, False, None))[:n]
        for idx in pair:
            (idx.pin if kind == "pin" else idx.unpin)(k)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHERS)
@given(data=st.data())
def test_backend_matches_reference_on_random_streams(name: str, data: st.DataObject) -> None:
    ref, other = create_backend("memory"), create_backend(name)
    try:
        if data.draw(st.booleans(), label="register"):
            for idx in (ref, other):
                idx.register_source(0, 0, model="m")
                idx.register_source(1, 1, model="m")
        stream = Stream()
        for _ in range(data.draw(st.integers(1, 25), label="steps")):
            step(data, stream, (ref, other))
            assert_same_state(ref, other)
        # Draining every source and pin leaves both empty.
        for idx in (ref, other):
            for w in range(3):
                idx.remove_worker(w)
            for family in FAMILIES:
                k = request_keys("", family, Variant(None, None, False, None))
                for n in range(1, len(family) + 1):
                    for _ in range(30):
                        idx.unpin(k[:n])
            st_ = idx.stats()
            assert (st_.blocks, st_.resident_pairs, st_.extra.get("nodes", 0)) == (0, 0, 0)
    finally:
        ref.close()
        other.close()
