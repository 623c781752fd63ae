"""SGLang's KV events, as each release really sends them: the golden frames made by
SGLang's own publisher (0.4.10 .. 0.5.23) through both decoders, the SGLang encoder
byte for byte against them, the replay layouts, and what the index makes of SGLang's
fields (`cache_salt`: namespace; `session_id`: not kept; `EXTERNAL`: the reporting
engine's remote tier)."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache import _native
from quillcache.connectors.replay import parse_reply
from quillcache.errors import EventDecodeError
from quillcache.events import pyref
from quillcache.events import sglang as sgl
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    normalize_medium,
)
from quillcache.index import Match, create_backend
from tests.events.sglang_golden import GOLDEN, RELEASES, Frame, expected_batch, frames, sent_events
from tests.events.test_decode import _agree
from tests.index.helpers import backends, keys

DECODERS = {"native": _native.decode_batch, "pyref": pyref.decode_batch}
FRAMES = frames()


@pytest.fixture(params=sorted(DECODERS))
def decode(request: pytest.FixtureRequest) -> Callable[[bytes], EventBatch]:
    return DECODERS[request.param]


@pytest.mark.parametrize("frame", FRAMES, ids=[f.id for f in FRAMES])
def test_every_release_decodes_to_what_sglang_was_asked_to_send(
    decode: Callable[[bytes], EventBatch], frame: Frame
) -> None:
    assert decode(frame.payload) == expected_batch(frame.sent)


@pytest.mark.parametrize("frame", FRAMES, ids=[f.id for f in FRAMES])
def test_the_encoder_writes_each_release_byte_for_byte(frame: Frame) -> None:
    wire = sgl.wire_of(frame.release)
    payload = sgl.encode_batch(
        sent_events(frame.sent), frame.sent["ts"], frame.sent["attn_dp_rank"], wire
    )
    assert payload.hex() == frame.payload.hex()


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_table_matches_the_wheels(release: str) -> None:
    """`wire_of` agrees with what each wheel declares and sends."""
    r = GOLDEN["releases"][release]
    wire = sgl.wire_of(release)
    stored = r["declared_fields"]["BlockStored"]
    assert wire.medium == ("medium" in stored)
    assert set(wire.optional) == set(stored[5:]) if wire.maps else True
    first = bytes.fromhex(r["frames"]["pub_rank0"][0]["frames_hex"][2])
    _ts, events, rank = msgpack.unpackb(first)
    assert isinstance(events[0], dict) == wire.maps
    assert rank == 0  # the publisher always writes the rank: three elements
    no_rank = msgpack.unpackb(bytes.fromhex(r["frames"]["msgspec_no_rank"][0]["payload_hex"]))
    assert len(no_rank) == 3 and no_rank[2] is None  # msgspec writes nil, never omits it
    reply = [bytes.fromhex(f) for f in r["replay"]["replies_hex"][0]]
    assert len(reply) == (4 if wire.replay_topic else 3)


def test_release_boundaries() -> None:
    assert not sgl.wire_of(sgl.LAST_ARRAY_RELEASE).maps
    assert sgl.wire_of(sgl.FIRST_MAP_RELEASE).maps
    assert sgl.wire_of("0.5.15.post1") == sgl.wire_of("0.5.9")
    assert sgl.wire_of("0.5.18").salt_metadata and not sgl.wire_of("0.5.17").salt_metadata
    assert not sgl.wire_of("0.5.21").replay_topic and sgl.wire_of("0.5.22").replay_topic
    for bad in ("0.4.6", "latest", "0.5", ""):
        with pytest.raises(ValueError):
            sgl.wire_of(bad)


@pytest.mark.parametrize("release", RELEASES)
def test_replay_replies_parse_to_the_live_frames(release: str) -> None:
    """The replay reply layout of each release (with or without the topic frame, and
    its end marker) reads back as the batches the SUB socket saw."""
    r = GOLDEN["releases"][release]
    live = [[bytes.fromhex(f) for f in item["frames_hex"]] for item in r["frames"]["pub_rank0"]]
    replies = [[bytes.fromhex(f) for f in rep] for rep in r["replay"]["replies_hex"]]
    parsed = [parse_reply(rep) for rep in replies]
    assert parsed[-1] is None  # the end marker
    assert parsed[:-1] == [(int.from_bytes(seq, "big"), payload) for _, seq, payload in live]
    if sgl.wire_of(release).replay_topic:
        assert all(rep[1] == live[0][0] for rep in replies[:-1])


# -- the 0.5.18-0.5.19 metadata map ----------------------------------------------------


def _array_stored(*tail: object) -> bytes:
    return msgpack.packb(
        [1.0, [["BlockStored", [-5], None, [1, 2], 2, None, "GPU", *tail]], 0], use_bin_type=True
    )


def test_metadata_map_is_the_salt_and_other_keys_are_skipped(
    decode: Callable[[bytes], EventBatch],
) -> None:
    (ev,) = decode(_array_stored({"future": [1, {"x": 2}], "cache_salt": "t"})).events
    assert isinstance(ev, BlockStored)
    assert (ev.cache_salt, ev.lora_name, ev.block_hashes) == ("t", None, ((-5) & (2**64 - 1),))
    (ev,) = decode(_array_stored("sql-lora")).events  # a str there is still vLLM's lora_name
    assert isinstance(ev, BlockStored) and (ev.cache_salt, ev.lora_name) == (None, "sql-lora")


@pytest.mark.parametrize(
    "meta",
    [{"cache_salt": 7}, {1: "x"}, {"cache_salt": ["t"]}, {"cache_salt": b"t"}],
)
def test_malformed_metadata_is_a_typed_error(
    decode: Callable[[bytes], EventBatch], meta: dict[object, object]
) -> None:
    with pytest.raises(EventDecodeError, match=r"events\[0\]\.metadata"):
        decode(_array_stored(meta))


def test_a_map_at_lora_name_in_map_form_is_still_an_error(
    decode: Callable[[bytes], EventBatch],
) -> None:
    payload = msgpack.packb(
        [1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                "token_ids": [1], "block_size": 1, "lora_name": {"cache_salt": "t"}}], 0]
    )  # fmt: skip
    with pytest.raises(EventDecodeError, match="lora_name"):
        decode(payload)


# -- SGLang shapes, generated: both decoders agree and return what was encoded ---------

wire_hashes = st.integers(-(1 << 63), (1 << 64) - 1)
names = st.none() | st.text(max_size=6)


@st.composite
def sglang_batches(draw: st.DrawFn) -> tuple[bytes, EventBatch]:
    wire = draw(st.sampled_from(sgl.RELEASES))
    events, decoded = [], []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["stored", "removed", "cleared"]))
        medium = draw(st.sampled_from([None, "GPU", "CPU_PINNED", "DISK", "EXTERNAL"]))
        hashes = draw(st.lists(wire_hashes, max_size=3))
        if kind == "stored":
            ev = BlockStored(
                block_hashes=hashes,
                parent_block_hash=draw(st.none() | wire_hashes),
                token_ids=draw(st.lists(st.integers(0, 2**32 - 1), max_size=8)),
                block_size=draw(st.integers(1, 64)),
                lora_id=draw(st.none() | st.integers(-(1 << 63), (1 << 63) - 1)),
                medium=medium,
                cache_salt=draw(names),
                session_id=draw(names),
                lora_name=draw(names),
            )
            keeps_salt = wire.salt_metadata or "cache_salt" in wire.optional
            decoded.append(
                BlockStored(
                    block_hashes=tuple(h & (2**64 - 1) for h in hashes),
                    parent_block_hash=None
                    if ev.parent_block_hash is None
                    else int(ev.parent_block_hash) & (2**64 - 1),
                    token_ids=tuple(ev.token_ids),
                    block_size=ev.block_size,
                    lora_id=ev.lora_id,
                    medium=sgl_norm(medium if wire.medium else None),
                    lora_name=ev.lora_name if "lora_name" in wire.optional else None,
                    extra_keys=(),
                    group_idx=0,
                    cache_salt=ev.cache_salt if keeps_salt else None,
                )
            )
            events.append(ev)
        elif kind == "removed":
            events.append(BlockRemoved(block_hashes=hashes, medium=medium))
            decoded.append(
                BlockRemoved(
                    tuple(h & (2**64 - 1) for h in hashes),
                    sgl_norm(medium if wire.medium else None),
                    0,
                )
            )
        else:
            events.append(AllBlocksCleared())
            decoded.append(AllBlocksCleared())
    ts = draw(st.floats(allow_nan=False))
    rank = draw(st.none() | st.integers(-(1 << 63), (1 << 63) - 1))
    return sgl.encode_batch(events, ts, rank, wire), EventBatch(ts, tuple(decoded), rank)


def sgl_norm(medium: str | None) -> str:
    return normalize_medium(medium)


@given(sglang_batches())
def test_generated_sglang_batches_decode_to_what_was_encoded(
    case: tuple[bytes, EventBatch],
) -> None:
    payload, expected = case
    assert _native.decode_batch(payload) == expected
    assert pyref.decode_batch(payload) == expected


@given(sglang_batches(), st.data())
def test_decoders_agree_on_mutated_and_truncated_sglang_batches(
    case: tuple[bytes, EventBatch], data: st.DataObject
) -> None:
    payload = bytearray(case[0])
    if payload:
        for _ in range(data.draw(st.integers(0, 3))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    _agree(bytes(payload))
    _agree(bytes(payload[:cut]))


# -- what the index makes of SGLang's fields -------------------------------------------

TOKENS = list(range(100, 116))  # four blocks of 4


HASHES = [-(i + 1) * 0x1234_5678_9ABC for i in range(4)]  # SGLang's are signed


def _store(wire: sgl.SglangWire, **fields: object) -> bytes:
    ev = BlockStored(
        block_hashes=HASHES,
        parent_block_hash=None,
        token_ids=TOKENS,
        block_size=4,
        lora_id=None,
        **fields,  # type: ignore[arg-type]
    )
    return sgl.encode_batch([ev], 1.0, 0, wire)


SALTED = [w for w in sgl.RELEASES if w.salt_metadata or "cache_salt" in w.optional]


@pytest.mark.parametrize("name", backends())
@pytest.mark.parametrize("wire", SALTED, ids=[w.first for w in SALTED])
def test_cache_salt_is_the_namespace_tenant(name: str, wire: sgl.SglangWire) -> None:
    index = create_backend(name)
    try:
        index.register_source(1, model="m", tokenizer="")
        index.apply(1, [_store(wire, medium="GPU", cache_salt="tenant-a", session_id="s1")])
        assert index.match(keys(TOKENS, model="m", tenant="tenant-a")) == [Match(1, 0, "GPU", 4)]
        assert index.match(keys(TOKENS, model="m")) == []
        assert index.match(keys(TOKENS, model="m", tenant="tenant-b")) == []
    finally:
        index.close()


@pytest.mark.parametrize("name", backends())
def test_session_id_is_not_part_of_residency(name: str) -> None:
    """Blocks stored for one session match a request of their namespace whatever its
    session, and a removal (which names no session) drops them."""
    wire = sgl.wire_of("0.5.23")
    index = create_backend(name)
    try:
        index.register_source(1, model="m", tokenizer="")
        index.apply(1, [_store(wire, medium="GPU", session_id="s1")])
        assert index.match(keys(TOKENS, model="m")) == [Match(1, 0, "GPU", 4)]
        gone = BlockRemoved(block_hashes=HASHES)
        index.apply(1, [sgl.encode_batch([gone], 2.0, 0, wire)])
        assert index.match(keys(TOKENS, model="m")) == []
    finally:
        index.close()


@pytest.mark.parametrize("name", backends())
def test_external_is_held_by_the_reporting_engine_only(name: str) -> None:
    """EXTERNAL (a shared remote pool such as Mooncake Store) is kept as its own medium
    on the engine that reported it: the index does not infer which other engines share
    the pool (docs/kv-events.md, "SGLang")."""
    wire = sgl.wire_of("0.5.23")
    index = create_backend(name)
    try:
        for worker in (1, 2):
            index.register_source(worker, model="m", tokenizer="")
        index.apply(2, [_store(wire, medium="EXTERNAL")])
        assert index.match(keys(TOKENS, model="m")) == [Match(2, 0, "EXTERNAL", 4)]
    finally:
        index.close()
