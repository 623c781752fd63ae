"""LMCache's residency as vLLM publishes it: the golden frames made by LMCache's and
vLLM's own connector code (`tests/vectors/lmcache_kv_events.json`) through both
decoders, `quillcache.events.lmcache` against them, the tier of every name LMCache uses,
and what the index makes of the frames (docs/kv-events.md, "LMCache")."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache import _native
from quillcache.connectors.sink import IndexSink
from quillcache.events import encode as enc
from quillcache.events import lmcache as lmc
from quillcache.events import pyref
from quillcache.events.types import BlockRemoved, BlockStored, EventBatch
from quillcache.index import Match, create_backend
from quillcache.routing.types import tier_of
from tests.events.test_decode import _agree
from tests.index.helpers import backends, keys

_PATH = Path(__file__).resolve().parent.parent / "vectors" / "lmcache_kv_events.json"
GOLDEN: dict[str, Any] = json.loads(_PATH.read_text())
CHUNK: int = GOLDEN["chunk_size"]
U64 = (1 << 64) - 1
DECODERS = {"native": _native.decode_batch, "pyref": pyref.decode_batch}
FRAMES = [
    (name, i, batch)
    for name, batches in GOLDEN["connectors"].items()
    for i, batch in enumerate(batches)
]
IDS = [f"{name}-{i}" for name, i, _ in FRAMES]


def _payload(batch: dict[str, Any]) -> bytes:
    return bytes.fromhex(batch["payload_hex"])


def _hash(value: int | dict[str, str]) -> int:
    """An engine hash as the decoders return it: vLLM's int mode keeps the value mod
    2^64 (LMCache's builtin hash may be negative); bytes mode, the last 8 bytes."""
    if isinstance(value, dict):
        return int.from_bytes(bytes.fromhex(value["bytes_hex"])[-8:], "big")
    return value & U64


def _from_lmcache(fields: dict[str, Any], *, removal: bool) -> BlockStored | BlockRemoved:
    """The decoded event for fields LMCache gave vLLM (its CacheStoreEvent's, or those
    vLLM's struct carried), normalised as the decoders normalise."""
    hashes = tuple(_hash(h) for h in fields["block_hashes"])
    if removal:
        return BlockRemoved(block_hashes=hashes, medium="CPU")
    parent = fields["parent_block_hash"]
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else _hash(parent),
        token_ids=tuple(fields["token_ids"]),
        block_size=fields["block_size"],
        medium="CPU",
        extra_keys=(),
    )


def _expected(name: str, batch: dict[str, Any]) -> EventBatch:
    sent = batch["sent"]
    if name == "vllm_connector":
        events = [_from_lmcache(e, removal=False) for e in sent["cache_store_events"]]
    else:
        events = [_from_lmcache(e, removal=e["type"] == "BlockRemoved") for e in batch["published"]]
    return EventBatch(ts=sent["ts"], events=tuple(events), dp_rank=0)


@pytest.fixture(params=sorted(DECODERS))
def decode(request: pytest.FixtureRequest) -> Callable[[bytes], EventBatch]:
    return DECODERS[request.param]


@pytest.mark.parametrize(("name", "i", "batch"), FRAMES, ids=IDS)
def test_every_frame_decodes_to_what_lmcache_reported(
    decode: Callable[[bytes], EventBatch], name: str, i: int, batch: dict[str, Any]
) -> None:
    assert decode(_payload(batch)) == _expected(name, batch)


def test_the_mp_connector_frames_are_the_server_records_with_vllms_hashes() -> None:
    """The MP connector's published events follow the server's records: a stored record
    is one BlockStored of one chunk, a removed record a BlockRemoved, and a new server
    incarnation withdraws every chunk still announced (what the golden frames show)."""
    decoded = [pyref.decode_batch(_payload(b)) for b in GOLDEN["connectors"]["mp_connector_int"]]
    digests = [
        bytes.fromhex(r["block_hashes"][0]["bytes_hex"])
        for b in GOLDEN["connectors"]["mp_connector_int"]
        for r in b["sent"]["server_batch"]["events"]
    ]
    h = [int.from_bytes(d, "big") & U64 for d in digests]  # vLLM's maybe_convert_block_hash
    assert [type(e).__name__ for b in decoded for e in b.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "BlockStored",
        "BlockRemoved",
    ]
    assert decoded[0].events[1].parent_block_hash == h[0]
    assert decoded[1].events[0].block_hashes == (h[2],)  # the removed record's hash
    assert sorted(decoded[3].events[0].block_hashes) == sorted([h[0], h[3]])


@pytest.mark.parametrize(("name", "i", "batch"), FRAMES, ids=IDS)
def test_the_lmcache_module_writes_what_vllm_publishes(
    name: str, i: int, batch: dict[str, Any]
) -> None:
    """`quillcache.events.lmcache` builds each frame's events from the same inputs, and
    they encode to the same msgpack values (map header widths aside: `encode` sizes
    them as vLLM 0.34 does, the frames come from vLLM 0.32)."""
    sent = batch["sent"]
    if name == "vllm_connector":
        wire = lmc.wire_of("vllm")
        stores = sent["cache_store_events"]
        tokens = [t for e in stores for t in e["token_ids"]]
        hashes = [e["block_hashes"][0] for e in stores]
        events: list[enc.Event] = list(lmc.stored_chunks(wire, tokens, hashes, CHUNK))
    else:
        wire = lmc.wire_of("mp")
        events = []
        for e in batch["published"]:
            hashes = [
                h if isinstance(h, int) else bytes.fromhex(h["bytes_hex"])
                for h in e["block_hashes"]
            ]
            if e["type"] == "BlockRemoved":
                events += lmc.removed_chunks(wire, hashes)
            else:
                p = e["parent_block_hash"]
                parent = p if p is None or isinstance(p, int) else bytes.fromhex(p["bytes_hex"])
                events += lmc.stored_chunks(wire, e["token_ids"], hashes, CHUNK, parent)
    ours = msgpack.unpackb(enc.encode_batch(events, ts=sent["ts"], dp_rank=0), raw=False)
    theirs = msgpack.unpackb(_payload(batch), raw=False)
    assert ours == theirs


def test_connector_shapes() -> None:
    vllm, mp = lmc.wire_of("vllm"), lmc.wire_of("mp")
    tokens = list(range(2 * CHUNK + 3))
    short = lmc.stored_chunks(vllm, tokens, [1, 2, 3], CHUNK)
    assert [e.block_size for e in short] == [CHUNK, CHUNK, 3]
    assert [e.parent_block_hash for e in short] == [None, 1, 2]
    assert [e.block_size for e in lmc.stored_chunks(mp, tokens, [1, 2], CHUNK)] == [CHUNK, CHUNK]
    assert lmc.removed_chunks(vllm, [1]) == []
    assert lmc.removed_chunks(mp, [1]) == [
        BlockRemoved(block_hashes=[1], medium="CPU", group_idx=None)
    ]
    with pytest.raises(ValueError, match="unknown LMCache connector"):
        lmc.wire_of("lmcache")
    with pytest.raises(ValueError, match="3 chunks need as many hashes"):
        lmc.stored_chunks(vllm, tokens, [1, 2], CHUNK)
    with pytest.raises(ValueError, match="chunk_size"):
        lmc.stored_chunks(vllm, tokens, [1], 0)


@pytest.mark.parametrize(("location", "tier"), sorted(GOLDEN["location_names"].items()))
def test_every_lmcache_location_name_has_its_tier(location: str, tier: str) -> None:
    assert tier_of(location) == tier


@pytest.mark.parametrize(("name", "i", "batch"), FRAMES, ids=IDS)
def test_every_connector_medium_is_the_cpu_tier(name: str, i: int, batch: dict[str, Any]) -> None:
    for event in _native.decode_batch(_payload(batch)).events:
        assert isinstance(event, (BlockStored, BlockRemoved))
        assert tier_of(event.medium) == "cpu"


@pytest.mark.parametrize("name", backends())
def test_the_index_follows_the_mp_connectors_stores_evictions_and_withdrawal(name: str) -> None:
    """Every backend holds LMCache's chunks on the CPU tier of the engine that published
    them, drops an evicted chunk and everything after a server restart. Requests are
    keyed at the chunk size here; at the engine's block size in the test below."""
    frames = [_payload(b) for b in GOLDEN["connectors"]["mp_connector_int"]]
    prompt = list(range(100, 100 + 2 * CHUNK))
    index = create_backend(name)
    try:
        index.register_source(1, model="m", tokenizer="")
        request = keys(prompt, model="m", block_size=CHUNK)
        index.apply(1, [frames[0]])
        assert index.match(request) == [Match(1, 0, "CPU", 2)]
        index.apply(1, [frames[1]])
        assert index.match(request) == [Match(1, 0, "CPU", 1)]
        index.apply(1, frames[2:])
        assert index.match(request) == []
        assert index.match(keys(list(range(50, 50 + CHUNK)), model="m", block_size=CHUNK)) == []
    finally:
        index.close()


@pytest.mark.parametrize("name", backends())
def test_lmcache_chunks_match_requests_at_the_engine_block_size(name: str) -> None:
    """Through the sink's chunk splitter (`quillcache.events.chunks`), LMCache's golden
    chunks are found by a request keyed at an engine block size that divides the chunk
    size, and an evicted chunk takes its engine blocks with it."""
    engine_block = CHUNK // 2
    frames = [_payload(b) for b in GOLDEN["connectors"]["mp_connector_int"]]
    index = create_backend(name)
    try:
        sink = IndexSink(index, block_size=engine_block)
        index.register_source(1, model="m", tokenizer="")
        request = keys(list(range(100, 100 + 2 * CHUNK)), model="m", block_size=engine_block)
        sink.ingest(1, [frames[0]])
        assert index.match(request) == [Match(1, 0, "CPU", 4)]
        sink.ingest(1, [frames[1]])
        assert index.match(request) == [Match(1, 0, "CPU", 2)]
        sink.ingest(1, frames[2:])
        assert index.match(request) == []
        assert sink.split_stats().split_chunks == 3  # the third one, stored and withdrawn
    finally:
        index.close()


_HASH = st.one_of(
    st.integers(0, U64), st.integers(-(2**63), -1), st.binary(min_size=8, max_size=32)
)


@given(
    connector=st.sampled_from(sorted(lmc.CONNECTORS)),
    chunk=st.integers(1, 6),
    n_tokens=st.integers(0, 20),
    hashes=st.lists(_HASH, min_size=20, max_size=20),
    data=st.data(),
)
def test_decoders_agree_on_lmcache_shaped_batches(
    connector: str, chunk: int, n_tokens: int, hashes: list[int | bytes], data: st.DataObject
) -> None:
    """LMCache's shapes (lower-case medium, short last chunk, one hash per event, signed
    ints and 8..32-byte digests) decode alike in both decoders, mutated and truncated
    too; unmutated, to the chunks and the CPU tier."""
    wire = lmc.wire_of(connector)
    tokens = list(range(n_tokens))
    events: list[enc.Event] = list(lmc.stored_chunks(wire, tokens, hashes, chunk))
    events += lmc.removed_chunks(wire, hashes[:2])
    payload = enc.encode_batch(events, ts=1.0, dp_rank=0)
    decoded = _native.decode_batch(payload)
    assert decoded == pyref.decode_batch(payload)
    stored = [e for e in decoded.events if isinstance(e, BlockStored)]
    assert [t for e in stored for t in e.token_ids] == tokens[: len(stored) * chunk]
    assert all(tier_of(e.medium) == "cpu" for e in decoded.events)  # type: ignore[union-attr]
    mutated = bytearray(payload)
    for _ in range(data.draw(st.integers(0, 3))):
        mutated[data.draw(st.integers(0, len(mutated) - 1))] = data.draw(st.integers(0, 255))
    _agree(bytes(mutated))
    _agree(bytes(mutated[: data.draw(st.integers(0, len(mutated)))]))
