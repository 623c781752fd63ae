"""The peer snapshot's format, the joiner's checks and restore, the replay-socket probe
against the engine simulator's real publisher, and the applier's consistent point."""

from __future__ import annotations

import asyncio
import struct
import threading
import time
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
import pytest
import xxhash
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.connectors import EventIngestor, IndexSink
from quillcache.connectors.replay import Holding, batch_digest, probe_holding
from quillcache.enginesim.publisher import KvEventPublisher
from quillcache.events.encode import encode_batch
from quillcache.events.types import BlockStored
from quillcache.gateway.bootstrap import (
    Bootstrapper,
    Expectations,
    LocalSource,
    _match_sources,
    _restore,
)
from quillcache.gateway.peer_snapshot import (
    DIGEST_BYTES,
    FORMAT_VERSION,
    PeerSnapshot,
    SnapshotError,
    SnapshotHeader,
    SourceEntry,
    decode,
    encode,
)
from quillcache.index.native import NativeIndex


def stored(uid: int, blocks: int = 1) -> bytes:
    """One batch storing `blocks` blocks of a chain no other uid shares."""
    tokens = [uid % 50_000, uid // 50_000] + [7] * (16 * blocks - 2)
    hashes = [uid * 1000 + i for i in range(blocks)]
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16
    )
    return encode_batch([event], 0.0)


def entry(
    worker: int, url: str, last: int = 3, *, exact: bool = True, rank: int = 0
) -> SourceEntry:
    return SourceEntry(
        worker=worker,
        url=url,
        dp_rank=rank,
        endpoint=f"tcp://e{worker}",
        replay_endpoint=f"tcp://r{worker}",
        last_seq=last,
        digest=123,
        exact=exact,
        why="" if exact else "stale",
    )


def header(sources: list[SourceEntry], fp: str = "fp") -> SnapshotHeader:
    return SnapshotHeader(
        secret_fingerprint=fp, block_size=16, tokenizer_id="", created_unix=0.0, blocks=0,
        sources=sources,
    )  # fmt: skip


def snapshot_bytes(image: bytes = b"image bytes" * 10) -> bytes:
    return b"".join(encode(header([entry(0, "http://a")]), image))


# -- format ------------------------------------------------------------------------------


def test_a_snapshot_round_trips() -> None:
    h = header([entry(0, "http://a"), entry(1, "http://b", exact=False)])
    snap = decode(b"".join(encode(h, b"\x00\x01image")))
    assert snap.header == h and snap.image == b"\x00\x01image"


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_truncation_is_refused(data: st.DataObject) -> None:
    raw = snapshot_bytes()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(SnapshotError) as err:
        decode(raw[:cut])
    assert err.value.reason in ("truncated", "corrupt")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_refused(data: st.DataObject) -> None:
    raw = bytearray(snapshot_bytes())
    at = data.draw(st.integers(0, len(raw) - 1))
    raw[at] ^= data.draw(st.integers(1, 255))
    with pytest.raises(SnapshotError):
        decode(bytes(raw))


def test_another_format_is_refused_by_name() -> None:
    raw = snapshot_bytes()
    other = raw[:8] + struct.pack(">I", FORMAT_VERSION + 1) + raw[12:]
    with pytest.raises(SnapshotError) as err:
        decode(other)
    assert err.value.reason == "version"
    assert "format" in str(err.value)


def test_trailing_bytes_are_refused() -> None:
    with pytest.raises(SnapshotError):
        decode(snapshot_bytes() + b"x")
    assert len(snapshot_bytes()) > DIGEST_BYTES


# -- matching and restore ------------------------------------------------------------------


def test_only_the_same_engine_at_the_same_id_is_a_candidate() -> None:
    local = [
        LocalSource(0, "http://a", 0, "tcp://e0", "tcp://r0"),
        LocalSource(1, "http://c", 0, "tcp://e1", "tcp://r1"),  # another engine at id 1
        LocalSource(2, "http://d", 0, "tcp://e2", "tcp://other"),
    ]
    peer = [
        entry(0, "http://a"),
        entry(1, "http://b"),
        entry(2, "http://d"),
        entry(3, "http://e", exact=False),
    ]
    candidates, dropped = _match_sources(peer, local)
    assert [c.worker for c in candidates] == [0]
    assert sorted(d["worker"] for d in dropped) == [1, 2, 3]


def _two_worker_image() -> tuple[NativeIndex, npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Worker 0 holds one 4-block chain, worker 1 another; their keys from block 0 on."""
    idx = NativeIndex()
    for w in (0, 1):
        idx.register_source(w, 0)
    idx.apply(0, [stored(1, 4)])
    idx.apply(1, [stored(2, 4)])
    by_worker: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for e in idx.entries():
        for h in e.holders:
            by_worker[h.worker].append((e.depth, e.key))
    k0 = np.array([k for _, k in sorted(by_worker[0])], dtype=np.uint64)
    k1 = np.array([k for _, k in sorted(by_worker[1])], dtype=np.uint64)
    return idx, k0, k1


def test_restore_keeps_the_kept_sources_and_drops_the_others() -> None:
    idx, k0, k1 = _two_worker_image()
    snap = PeerSnapshot(header([entry(0, "http://a"), entry(1, "http://b")]), idx.snapshot())
    kept = {(0, 0): snap.header.sources[0]}
    restored = _restore(snap, kept)
    assert {m.worker: m.blocks for m in restored.match(k0)} == {0: 4}
    assert restored.match(k1) == []  # worker 1's residency is gone, not kept stale
    assert restored.stats().blocks == 4


def test_restore_drops_the_peers_pins() -> None:
    idx, k0, _ = _two_worker_image()
    idx.pin(k0)
    idx.pin(k0[:2])
    assert idx.stats().extra["pinned"] > 0
    snap = PeerSnapshot(header([entry(0, "http://a"), entry(1, "http://b")]), idx.snapshot())
    restored = _restore(snap, {(0, 0): snap.header.sources[0], (1, 0): snap.header.sources[1]})
    assert restored.stats().extra["pinned"] == 0
    assert {m.worker: m.blocks for m in restored.match(k0)} == {0: 4}


def test_an_image_with_sources_its_header_does_not_list_is_refused() -> None:
    idx, _, _ = _two_worker_image()
    snap = PeerSnapshot(header([entry(0, "http://a")]), idx.snapshot())  # worker 1 unlisted
    with pytest.raises(SnapshotError) as err:
        _restore(snap, {(0, 0): snap.header.sources[0]})
    assert err.value.reason == "corrupt"


def test_a_damaged_image_is_refused() -> None:
    idx, _, _ = _two_worker_image()
    image = bytearray(idx.snapshot())
    image[len(image) // 2] ^= 0x55
    snap = PeerSnapshot(header([entry(0, "http://a"), entry(1, "http://b")]), bytes(image))
    with pytest.raises(SnapshotError) as err:
        _restore(snap, {(0, 0): snap.header.sources[0]})
    assert err.value.reason == "corrupt"


def test_a_peer_with_another_secret_or_block_size_is_refused() -> None:
    snap = PeerSnapshot(header([], fp="theirs"), b"")
    expect = Expectations(["mine"], 16, "", [])
    with pytest.raises(SnapshotError) as err:
        Bootstrapper._check_header(snap, expect)
    assert err.value.reason == "secret"
    with pytest.raises(SnapshotError) as err:
        Bootstrapper._check_header(snap, Expectations(["theirs"], 32, "", []))
    assert err.value.reason == "mismatch"


def test_no_peer_to_ask_is_a_cold_start() -> None:
    boot = Bootstrapper(token=None, timeout_s=1.0, max_bytes=1 << 20, replay_timeout_s=0.2)
    result = asyncio.run(boot.run([], Expectations(["fp"], 16, "", [])))
    assert result.index is None and result.report.outcome == "none"


def test_a_peer_that_is_down_is_a_cold_start() -> None:
    boot = Bootstrapper(token="t", timeout_s=1.0, max_bytes=1 << 20, replay_timeout_s=0.2)
    result = asyncio.run(
        boot.run([("url", "http://127.0.0.1:9")], Expectations(["fp"], 16, "", []))
    )
    assert result.index is None and result.resume == {}
    assert result.report.outcome == "refused"
    assert [r["reason"] for r in result.report.refusals] == ["peer"]


# -- the replay-socket probe against the engine simulator's publisher ----------------------


@pytest.fixture
def publisher() -> Iterator[KvEventPublisher]:
    pub = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4)
    try:
        yield pub
    finally:
        pub.close()


def test_probe_holding(publisher: KvEventPublisher) -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    payloads = [stored(i) for i in range(6)]
    for p in payloads:
        publisher.publish(p)
    ep = publisher.replay_endpoint
    assert ep is not None
    # seqs 2..5 are in the 4-batch buffer
    assert probe_holding(ctx, ep, 5, batch_digest(payloads[5])) is Holding.HELD
    assert probe_holding(ctx, ep, 3, batch_digest(payloads[3])) is Holding.HELD
    assert probe_holding(ctx, ep, 3, batch_digest(payloads[4])) is Holding.OTHER_BYTES
    assert probe_holding(ctx, ep, 1, batch_digest(payloads[1])) is Holding.BUFFER_MOVED_ON
    assert probe_holding(ctx, ep, 9, 0) is Holding.NOT_PUBLISHED


def test_probe_of_a_restarted_engine_and_of_a_dead_socket() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    first = KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=64)
    for i in range(3):
        first.publish(stored(i))
    ep = first.replay_endpoint
    assert ep is not None
    digest = batch_digest(stored(2))
    first.close()
    # a new engine life on the same replay socket: numbering again from 0, other bytes
    second = KvEventPublisher("tcp://127.0.0.1:*", ep, buffer_steps=64)
    try:
        for i in range(5):
            second.publish(stored(100 + i))
        assert probe_holding(ctx, ep, 2, digest) is Holding.OTHER_BYTES
    finally:
        second.close()
    assert probe_holding(ctx, ep, 2, digest, timeout_s=0.2) is Holding.NO_ANSWER


# -- the applier's consistent point -------------------------------------------------------


def test_the_image_and_the_seqs_are_taken_at_one_point_of_the_applier() -> None:
    """Batch i stores one block of its own, so an image consistent with a source at
    seq L holds exactly L + 1 of its blocks. Taken while batches stream in."""
    index = NativeIndex()
    index.register_source(0, 0)
    ingestor = EventIngestor(IndexSink(index), apply_bytes=256, quiet_tail_s=0)
    stop = threading.Event()
    total = 3000

    def feed() -> None:
        for seq in range(total):
            while not ingestor.submit(0, [stored(seq + 1)], 0, seq=seq):
                time.sleep(0.001)
        stop.set()

    def take() -> tuple[int, int]:
        image = NativeIndex.from_snapshot(index.snapshot())
        [position] = ingestor.positions()
        return image.stats().blocks, position.last_seq

    feeder = threading.Thread(target=feed)
    feeder.start()
    seen = []
    try:
        while not stop.is_set():
            blocks, last = ingestor.on_applier(take).result(timeout=10)
            assert blocks == last + 1, (blocks, last)
            seen.append(last)
        feeder.join()
        ingestor.wait_idle()
        # once more at the stream's end: a loaded host may have let the loop above take
        # a single point while the feeder ran
        blocks, last = ingestor.on_applier(take).result(timeout=10)
        assert (blocks, last) == (total, total - 1)
        seen.append(last)
    finally:
        feeder.join()
        ingestor.close()
    assert len(set(seen)) >= 2  # taken at more than one point of the stream


def test_a_call_after_close_fails_instead_of_hanging() -> None:
    ingestor = EventIngestor(IndexSink(NativeIndex()))
    ingestor.close()
    with pytest.raises(RuntimeError):
        ingestor.on_applier(lambda: 1).result(timeout=1)


def test_a_header_with_sources_of_bad_types_is_refused() -> None:
    """A well-framed snapshot (right length, right digest) whose header names a worker
    by a string: refused at decode, before anything reaches the index."""
    head = header([entry(0, "http://a")]).to_json().replace(b'"worker":0', b'"worker":"0"')
    prefix = b"QCPEERSN" + struct.pack(">II", FORMAT_VERSION, len(head)) + head
    body = prefix + struct.pack(">Q", 3) + b"img"
    with pytest.raises(SnapshotError) as err:
        decode(body + xxhash.xxh3_128_digest(body))
    assert err.value.reason == "corrupt"
    assert "bad types" in str(err.value)
