"""The encoder reproduces vLLM's bytes exactly (golden frames of specs/kv-events.md)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings

from quillcache.events import EventBatch, decode_batch, pyref
from quillcache.events.encode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    encode_batch,
    encode_event,
    frame,
)
from tests.events import strategies
from tests.events.golden import FRAMES, TOPIC

GOLDEN_EVENTS = {
    0: (
        1700000000.5,
        [
            BlockStored(
                block_hashes=[15742999346994867921, 18369614221190020847],
                parent_block_hash=None,
                token_ids=[1, 2, 3, 4, 5, 6, 7, 8],
                block_size=4,
                extra_keys=[None, None],
            )
        ],
    ),
    1: (1700000001.25, [BlockRemoved(block_hashes=[18369614221190020847]), AllBlocksCleared()]),
    2: (
        1700000002.0,
        [
            BlockStored(
                block_hashes=[bytes(range(32))],
                parent_block_hash=bytes(32),
                token_ids=[7, 8, 9, 10],
                block_size=4,
                lora_id=3,
                lora_name="my-lora",
                extra_keys=[("my-lora", ("mmhash", 0), "salt")],
                group_idx=1,
                session_id="s1",
                lookahead_token_ids=[[11]],
            )
        ],
    ),
}


@pytest.mark.parametrize(("seq", "payload", "_expected"), FRAMES)
def test_golden_frames_are_reproduced_byte_for_byte(
    seq: int, payload: bytes, _expected: object
) -> None:
    ts, events = GOLDEN_EVENTS[seq]
    assert encode_batch(events, ts, 0).hex() == payload.hex()


def test_frame_is_topic_seq_payload() -> None:
    seq, payload, _ = FRAMES[1]
    parts = frame(TOPIC, seq, payload)
    assert parts == [TOPIC, bytes.fromhex("0000000000000001"), payload]
    assert frame(b"", 2**64 - 1, b"")[1] == b"\xff" * 8


@pytest.mark.parametrize("seq", [-1, 2**64])
def test_frame_rejects_seq_outside_u64(seq: int) -> None:
    with pytest.raises(ValueError, match="seq"):
        frame(b"", seq, b"")


def test_map_form_omits_nil_optionals_but_keeps_required_nils() -> None:
    ev = BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        medium=None,
        group_idx=None,
    )
    decoded = msgpack.unpackb(encode_event(ev))
    assert list(decoded) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]
    assert decoded["medium"] is None


def test_array_form_lists_fields_in_declaration_order() -> None:
    ev = BlockStored(
        block_hashes=[-5], parent_block_hash=7, token_ids=[1, 2], block_size=2, group_idx=None
    )
    assert msgpack.unpackb(encode_event(ev, positional=True)) == [
        "BlockStored",
        [-5],
        7,
        [1, 2],
        2,
        None,
        "GPU",
        None,
    ]
    removed = BlockRemoved(block_hashes=[b"\x01" * 16], medium="CPU", group_idx=2)
    assert msgpack.unpackb(encode_event(removed, positional=True)) == [
        "BlockRemoved",
        [b"\x01" * 16],
        "CPU",
        2,
    ]
    assert msgpack.unpackb(encode_event(AllBlocksCleared(), positional=True)) == [
        "AllBlocksCleared"
    ]


def test_batch_without_rank_has_two_elements() -> None:
    assert msgpack.unpackb(encode_batch([], 1.5, None)) == [1.5, []]
    assert msgpack.unpackb(encode_batch([], 2, 3)) == [2.0, [], 3]


@settings(max_examples=200, deadline=None)
@given(strategies.batches())
def test_a_decoded_batch_encodes_again_to_what_decodes_the_same(
    case: tuple[bytes, EventBatch],
) -> None:
    """One set of event classes: what a decoder returns is what the encoder writes."""
    payload, _ = case
    decoded = decode_batch(payload)
    again = encode_batch(list(decoded.events), decoded.ts, decoded.dp_rank)
    assert decode_batch(again) == decoded
    assert pyref.decode_batch(again) == decoded
