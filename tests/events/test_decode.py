"""Both decoders (native Rust, pure-Python reference): golden frames, every shape,
typed rejections, and agreement with each other on generated and mutated bytes."""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache import _native
from quillcache.errors import EventDecodeError
from quillcache.events import encode as enc
from quillcache.events import pyref
from quillcache.events.pyref import MAX_DEPTH
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    MmKey,
    RawKey,
)
from tests.events.golden import FRAMES
from tests.events.strategies import batches

DECODERS = {"native": _native.decode_batch, "pyref": pyref.decode_batch}
Decoder = Callable[[bytes], EventBatch]


@pytest.fixture(params=sorted(DECODERS))
def decode_batch(request: pytest.FixtureRequest) -> Decoder:
    return DECODERS[request.param]


def _extra_key_from_json(item: dict[str, Any]) -> Any:
    if "str" in item:
        return item["str"]
    if "mm" in item:
        return MmKey(*item["mm"])
    return RawKey(bytes.fromhex(item["raw_hex"]))


def batch_from_golden(expected: dict[str, Any]) -> EventBatch:
    events: list[Any] = []
    for e in expected["events"]:
        if e["type"] == "BlockStored":
            extra = e["extra_keys"] or []
            events.append(
                BlockStored(
                    block_hashes=tuple(e["block_hashes"]),
                    parent_block_hash=e["parent_block_hash"],
                    token_ids=tuple(e["token_ids"]),
                    block_size=e["block_size"],
                    lora_id=e["lora_id"],
                    medium=e["medium"],
                    lora_name=e["lora_name"],
                    extra_keys=tuple(
                        None if b is None else tuple(_extra_key_from_json(i) for i in b)
                        for b in extra
                    ),
                    group_idx=e["group_idx"],
                    cache_salt=e["cache_salt"],
                )
            )
        elif e["type"] == "BlockRemoved":
            events.append(BlockRemoved(tuple(e["block_hashes"]), e["medium"], e["group_idx"]))
        else:
            events.append(AllBlocksCleared())
    return EventBatch(expected["ts"], tuple(events), expected["dp_rank"])


@pytest.mark.parametrize(("seq", "payload", "expected"), FRAMES)
def test_golden_frames_decode_to_the_documented_values(
    decode_batch: Decoder, seq: int, payload: bytes, expected: dict[str, Any]
) -> None:
    assert decode_batch(payload) == batch_from_golden(expected)


@given(batches())
def test_round_trip_of_generated_batches(case: tuple[bytes, EventBatch]) -> None:
    payload, expected = case
    assert _native.decode_batch(payload) == expected
    assert pyref.decode_batch(payload) == expected


def test_signed_and_bytes_hashes_normalise_to_u64(decode_batch: Decoder) -> None:
    payload = enc.encode_batch(
        [enc.BlockRemoved(block_hashes=[-1, -(2**63), 5, b"\x00" * 8 + b"\x01" * 8])], 0.0, 0
    )
    (removed,) = decode_batch(payload).events
    assert removed.block_hashes == (2**64 - 1, 2**63, 5, 0x0101010101010101)


def test_sglang_style_fields_and_media(decode_batch: Decoder) -> None:
    stored = enc.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[3, 4],
        block_size=2,
        medium="CPU_PINNED",
        cache_salt="tenant-a",
        group_idx=None,
    )
    payload = enc.encode_batch([stored], 1.0, 2)
    (ev,) = decode_batch(payload).events
    assert (ev.medium, ev.cache_salt, ev.group_idx) == ("CPU", "tenant-a", 0)


def _bad(obj: Any) -> bytes:
    return msgpack.packb(obj)


GOOD_EVENT = {"type": "BlockRemoved", "block_hashes": [1]}
MALFORMED = {
    "not an array": (_bad({"ts": 1.0}), "batch"),
    "four elements": (_bad([1.0, [], 0, 0]), "4 elements"),
    "ts is a string": (_bad(["x", [], 0]), "batch.ts"),
    "events not a list": (_bad([1.0, 5, 0]), "batch.events"),
    "event is an int": (_bad([1.0, [7], 0]), "expected an event"),
    "no type key": (_bad([1.0, [{"block_hashes": [1]}], 0]), "no 'type'"),
    "unknown type": (_bad([1.0, [{"type": "Nope"}], 0]), "unknown event type"),
    "missing field": (_bad([1.0, [{"type": "BlockStored", "block_hashes": []}], 0]), "token_ids"),
    "token too big": (
        _bad([1.0, [["BlockStored", [1], None, [1, 2**32], 2]], 0]),
        "token_ids[1]",
    ),
    "negative token": (_bad([1.0, [["BlockStored", [1], None, [-1], 1]], 0]), "token_ids[0]"),
    "short digest": (
        _bad([1.0, [{"type": "BlockRemoved", "block_hashes": [b"abc"]}], 0]),
        "3 bytes",
    ),
    "hash is str": (
        _bad([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}], 0]),
        "block_hashes[0]",
    ),
    "zero block size": (_bad([1.0, [["BlockStored", [], None, [], 0]], 0]), "block_size"),
    "medium is int": (
        _bad([1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": 3}], 0]),
        "medium",
    ),
    "int map key": (_bad([1.0, [{1: 2, "type": "AllBlocksCleared"}], 0]), "field name"),
    "short positional": (_bad([1.0, [["BlockStored", [1], None]], 0]), "at least 4"),
    "trailing bytes": (_bad([1.0, [], 0]) + b"\x00", "trailing"),
    "truncated": (_bad([1.0, [GOOD_EVENT], 0])[:-3], "truncated"),
    "2 GiB bin prefix": (
        b"\x92\xcb" + b"\x00" * 8 + b"\x91\x92\xacBlockRemoved\x91\xc6\x80\x00\x00\x00\x01",
        "events[0].block_hashes: truncated",
    ),
    "4G array prefix": (b"\x93\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", "4294967295"),
    "reserved marker": (b"\x93\xcb" + b"\x00" * 8 + b"\x91\xc1", "events[0]"),
    "invalid utf-8 type": (b"\x93\x00\x91\x81\xa4type\xa2\xff\xfe\x00", "events[0]"),
    "dp_rank is a float": (_bad([1.0, [], 1.5]), "dp_rank"),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_input_raises_a_typed_error_naming_where(
    decode_batch: Decoder, name: str
) -> None:
    payload, needle = MALFORMED[name]
    with pytest.raises(EventDecodeError, match="at byte") as info:
        decode_batch(payload)
    assert needle in str(info.value)


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def test_unknown_fields_are_skipped_up_to_the_depth_limit(decode_batch: Decoder) -> None:
    # The unknown value sits at depth 4 (batch > events > event > value).
    ok = _bad([1.0, [{"type": "AllBlocksCleared", "future": _nested(MAX_DEPTH - 3)}], 0])
    assert decode_batch(ok).events == (AllBlocksCleared(),)
    deep = _bad([1.0, [{"type": "AllBlocksCleared", "future": _nested(MAX_DEPTH - 2)}], 0])
    with pytest.raises(EventDecodeError, match="nesting deeper"):
        decode_batch(deep)


def test_extra_key_items_are_classified(decode_batch: Decoder) -> None:
    item_raw = _bad({"k": 1})
    payload = _bad(
        [
            1.0,
            [
                [
                    "BlockStored",
                    [1],
                    None,
                    [1],
                    1,
                    None,
                    None,
                    None,
                    [["lora", ["img", -3], {"k": 1}, ["img", 2**63]], None],
                ]
            ],
            0,
        ]
    )
    (ev,) = decode_batch(payload).events
    assert ev.extra_keys == (
        ("lora", MmKey("img", -3), RawKey(item_raw), RawKey(_bad(["img", 2**63]))),
        None,
    )


def _outcome(decode: Decoder, data: bytes) -> EventBatch | str:
    try:
        batch = decode(data)
    except EventDecodeError:
        return "rejected"
    # NaN != NaN: compare timestamps by their bits.
    return dataclasses.replace(batch, ts=struct.pack(">d", batch.ts))  # type: ignore[arg-type]


def _agree(data: bytes) -> None:
    native, reference = _outcome(_native.decode_batch, data), _outcome(pyref.decode_batch, data)
    assert native == reference, data.hex()


@given(st.binary(max_size=64))
def test_decoders_agree_on_arbitrary_bytes(data: bytes) -> None:
    _agree(data)


@given(batches(), st.data())
def test_decoders_agree_on_mutated_and_truncated_batches(
    case: tuple[bytes, EventBatch], data: st.DataObject
) -> None:
    payload = bytearray(case[0])
    if payload:
        for _ in range(data.draw(st.integers(0, 3))):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    _agree(bytes(payload))
    _agree(bytes(payload[:cut]))


def test_errors_carry_the_offset(decode_batch: Decoder) -> None:
    payload = _bad([1.0, [["BlockStored", [1], None, [1, -1], 2]], 0])
    with pytest.raises(EventDecodeError) as info:
        decode_batch(payload)
    assert info.value.offset == payload.index(b"\xff")
    assert str(info.value).startswith("events[0].token_ids")


def test_exceptions_report_the_native_module() -> None:
    assert EventDecodeError.__module__ == "quillcache._native"
