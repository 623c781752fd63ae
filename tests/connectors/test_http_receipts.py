"""HTTP ingest through the ingestor: each batch is decoded once, by the index that applies
it, and the caller's receipt says what became of every batch of its call."""

from __future__ import annotations

import collections
from collections.abc import Iterator, Sequence
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.connectors import EventIngestor, IngestReceipt
from quillcache.connectors.sink import IndexSink
from quillcache.events import EventBatch
from quillcache.events.encode import BlockStored, encode_batch
from quillcache.events.pyref import decode_batch
from quillcache.index import create_backend, memory
from quillcache.index.types import ApplyStats

BAD = b"\x93\xcb\x00"  # a batch array that declares 3 elements and ends after 2 bytes


class CountingSink(IndexSink):
    """Over the pure-Python index, counting how often each payload is decoded."""

    def __init__(self) -> None:
        super().__init__(create_backend("memory"))
        self.decoded: collections.Counter[bytes] = collections.Counter()

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        def counted(payload: bytes) -> EventBatch:
            self.decoded[bytes(payload)] += 1
            return decode_batch(payload)

        with mock.patch.object(memory, "decode_batch", counted):
            return super().ingest(worker, payloads, dp_rank, seqs)


@pytest.fixture
def sink() -> CountingSink:
    return CountingSink()


@pytest.fixture
def ingestor(sink: CountingSink) -> Iterator[EventIngestor]:
    ing = EventIngestor(sink, replay_timeout_s=0.5)
    yield ing
    ing.close()


def good(i: int) -> bytes:
    stored = BlockStored([1000 + i], None, list(range(16 * i, 16 * i + 16)), 16)
    return encode_batch([stored], float(i))


def submit(ing: EventIngestor, payloads: list[bytes], seq: int | None = None) -> IngestReceipt:
    receipt = IngestReceipt(len(payloads))
    assert ing.submit(7, payloads, 0, seq, receipt) == len(payloads)
    receipt.done.result(timeout=5)
    return receipt


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_the_receipt_names_every_invalid_batch_and_each_batch_is_decoded_once(
    valid: list[bool],
) -> None:
    sink = CountingSink()
    ing = EventIngestor(sink, replay_timeout_s=0.5)
    try:
        payloads = [good(i) if ok else BAD + bytes([i]) for i, ok in enumerate(valid)]
        receipt = submit(ing, payloads)
    finally:
        ing.close()
    assert receipt.applied == sum(valid)
    assert [i for i, _ in receipt.invalid] == [i for i, ok in enumerate(valid) if not ok]
    # the index decoded every batch exactly once: nothing decoded it to check it first
    assert sink.decoded == collections.Counter(payloads)
    assert sink.index.stats().blocks == sum(valid)


def test_consecutive_sequenced_calls_are_each_applied_once(
    ingestor: EventIngestor, sink: CountingSink
) -> None:
    first = submit(ingestor, [good(0), good(1), good(2)], seq=0)
    then = submit(ingestor, [good(3), good(4)], seq=3)
    assert (first.applied, first.invalid, then.applied, then.invalid) == (3, [], 2, [])
    assert sink.decoded == collections.Counter(good(i) for i in range(5))
    assert ingestor.sources[(7, 0)].tracker.last == 4


def test_a_sequenced_invalid_batch_is_named_by_its_place_in_the_call(
    ingestor: EventIngestor,
) -> None:
    receipt = submit(ingestor, [good(0), BAD, good(2)], seq=10)
    assert receipt.applied == 2
    assert [i for i, _ in receipt.invalid] == [1]
    assert "declares 3 elements" in receipt.invalid[0][1]  # the decoder's own words


def test_a_call_that_does_not_fit_the_queue_is_refused_whole(sink: CountingSink) -> None:
    ing = EventIngestor(sink, replay_timeout_s=0.5, queue_size=2)
    try:
        receipt = IngestReceipt(3)
        assert ing.submit(7, [good(0), good(1), good(2)], 0, None, receipt) == 0
        assert not receipt.done.done()
        assert not sink.decoded
    finally:
        ing.close()
