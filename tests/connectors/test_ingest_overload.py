"""Event ingest under overload: a flood far beyond what the gateway applies, then quiet.

A publisher process (vLLM-style PUB + ROUTER replay, its own GIL) publishes batches
whose final truth the test knows: resident batches (stored, kept), evicted ones
(stored, later removed) and flood traffic (store/remove pairs) in between. The gateway
side is an `EventIngestor` over a native-index `ControlPlane` whose apply is made the
bottleneck (a per-batch delay, GIL released, like a heavy Rust apply). Within 5 s of the
publisher's last frame the index must equal the truth exactly, with no restart counted.
"""

from __future__ import annotations

import collections.abc
import contextlib
import multiprocessing
import multiprocessing.connection
import time
from collections.abc import Sequence
from typing import Any

import pytest

from quillcache.connectors import EventIngestor, ZmqSourceConfig
from quillcache.connectors.sink import ControlPlaneSink
from quillcache.controlplane import ControlPlane
from quillcache.events.encode import BlockRemoved, BlockStored, encode_batch
from quillcache.index.native import NativeIndex
from quillcache.index.types import ApplyStats

BLOCKS = 4  # per batch
RESIDENT = 200  # batches stored and kept
EVICTED = 100  # batches stored, then removed
FLOOD_POOL = 256  # flood ids, stored and removed again and again
DELAY_PER_BATCH_S = 250e-6  # the slow apply: what makes the gateway the bottleneck
RECOVERY_S = 5.0


def stored(i: int) -> bytes:
    hashes = [(1 << 40) + i * BLOCKS + b for b in range(BLOCKS)]
    tokens = [(i * 16 * BLOCKS + t) % (1 << 31) for t in range(16 * BLOCKS)]
    event = BlockStored(
        block_hashes=hashes, parent_block_hash=None, token_ids=tokens, block_size=16
    )
    return encode_batch([event], ts=float(i))


def removed(i: int) -> bytes:
    hashes = [(1 << 40) + i * BLOCKS + b for b in range(BLOCKS)]
    return encode_batch([BlockRemoved(block_hashes=hashes)], ts=float(i))


def plan(flood_pairs: int) -> list[bytes]:
    """The publisher's batches in order, truth spread through the flood: the evicted
    batches stored in the first half and removed in the second, the resident ones
    throughout, the last 20 of them closing the stream (a tail with nothing after it)."""
    flood_base = RESIDENT + EVICTED
    truth = [stored(RESIDENT + j) for j in range(EVICTED)] + [stored(i) for i in range(RESIDENT)]
    truth[EVICTED:EVICTED] = [removed(RESIDENT + j) for j in range(EVICTED)]
    closing = truth[-20:]
    spread = truth[:-20]
    every = max(1, flood_pairs // len(spread))
    out: list[bytes] = []
    for k in range(flood_pairs):
        fid = flood_base + k % FLOOD_POOL
        out += [stored(fid), removed(fid)]
        if k % every == 0 and k // every < len(spread):
            out.append(spread[k // every])
    out += spread[flood_pairs // every + 1 :] if flood_pairs // every + 1 < len(spread) else []
    return out + closing


def publisher_main(conn: multiprocessing.connection.Connection, flood_pairs: int) -> None:
    from quillcache.enginesim.publisher import KvEventPublisher

    payloads = plan(flood_pairs)
    pub = KvEventPublisher(
        "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=len(payloads) + 10
    )
    conn.send((pub.endpoint, pub.replay_endpoint))
    conn.recv()  # go
    t0 = time.monotonic()
    for p in payloads:
        pub.publish(p)
    t1 = time.monotonic()
    conn.send((len(payloads), t0, t1))
    conn.recv()  # stop
    pub.close()


class SlowSink(ControlPlaneSink):
    """Apply costs a fixed time per batch, GIL released (like a heavy native apply)."""

    def ingest(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seqs: Sequence[int] | None = None,
    ) -> ApplyStats:
        time.sleep(DELAY_PER_BATCH_S * len(payloads))
        return super().ingest(worker, payloads, dp_rank, seqs)


def content_keys(payloads: Sequence[bytes]) -> set[int]:
    index = NativeIndex()
    index.apply(0, list(payloads))
    return {e.key for e in index.entries()}


def held_keys(plane: ControlPlane) -> set[int]:
    return {
        e.key
        for e in plane.index.entries()
        if any((h.worker, h.dp_rank) == (0, 0) for h in e.holders)
    }


def apply_capacity(sink: SlowSink, apply_bytes: int) -> float:
    """Batches/s the sink applies when fed in the ingestor's slices: an upper bound of
    the gateway's ingest capacity (receiving and queueing only add to it)."""
    sample = [stored(10_000 + i) for i in range(400)] + [removed(10_000 + i) for i in range(400)]
    per_slice = max(1, apply_bytes // len(sample[0]))
    t0 = time.perf_counter()
    for i in range(0, len(sample), per_slice):
        sink.ingest(0, sample[i : i + per_slice], 0)
    return len(sample) / (time.perf_counter() - t0)


@contextlib.contextmanager
def publisher_process(
    flood_pairs: int,
) -> collections.abc.Iterator[tuple[multiprocessing.connection.Connection, str, str]]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=publisher_main, args=(child, flood_pairs), daemon=True)
    proc.start()
    try:
        assert parent.poll(20), "publisher process did not start"
        endpoint, replay = parent.recv()
        yield parent, endpoint, replay
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()


@pytest.mark.parametrize(
    "case",
    [
        # the queue overflows: batches dropped, gaps replayed, the tail synced
        {"queue_size": 1_000, "flood_pairs": 6_000, "drops": True},
        # nothing dropped, but a long backlog is still queued when the source goes quiet
        {"queue_size": 100_000, "flood_pairs": 5_000, "drops": False},
    ],
    ids=["flood-with-drops", "backlog-left-when-quiet"],
)
def test_after_a_flood_the_index_equals_the_truth(case: dict[str, Any]) -> None:
    plane = ControlPlane(index="native", router="round-robin", block_size=16)
    plane.add_worker(0, capacity_blocks=10**7)
    sink = SlowSink(plane)
    capacity = apply_capacity(sink, 32 * 1024)
    plane.clear(0)
    resident = content_keys([stored(i) for i in range(RESIDENT)])
    evicted = content_keys([stored(RESIDENT + j) for j in range(EVICTED)])
    flood = content_keys([stored(RESIDENT + EVICTED + k) for k in range(FLOOD_POOL)])
    assert len(resident) == RESIDENT * BLOCKS and not resident & (evicted | flood)

    # A short replay timeout: an idle wait now, it used to be a deadline for the whole
    # transfer (a long replay cut short, the source marked stale, again and again).
    ingestor = EventIngestor(
        sink, queue_size=case["queue_size"], quiet_tail_s=0.5, replay_timeout_s=0.2
    )
    try:
        with publisher_process(case["flood_pairs"]) as (conn, endpoint, replay):
            status = ingestor.add_zmq_source(ZmqSourceConfig(0, endpoint, replay))
            deadline = time.monotonic() + 10
            while not status.peer_connects and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(0.3)  # the subscription reaches the PUB
            conn.send("go")
            assert conn.poll(30), "publisher did not finish"
            published, t0, t_last = conn.recv()
            rate = published / (t_last - t0)
            print(f"capacity {capacity:,.0f}/s, flood {rate:,.0f}/s, {published} batches")
            assert rate / capacity >= 10, (rate, capacity)

            def caught_up() -> bool:
                return status.last_seq == published - 1 and held_keys(plane) == resident

            while time.monotonic() < t_last + RECOVERY_S and not caught_up():
                time.sleep(0.05)
            recovered_after = time.monotonic() - t_last
            held = held_keys(plane)
            assert not resident - held, f"{len(resident - held)} resident blocks missing"
            assert not held & evicted, f"{len(held & evicted)} evicted blocks still held"
            assert not held & flood, f"{len(held & flood)} flood blocks still held"
            assert held == resident
            assert status.restarts == 0 and status.restart_suspects == 0
            assert status.stale_marks == 0 and not status.stale
            assert status.implausible_seqs == 0
            assert (status.dropped > 0) is case["drops"], status.dropped
            assert status.last_seq == published - 1
            # a replay never fetches what is applied or queued: only what was dropped
            assert status.replayed_batches <= status.dropped, status.replayed_batches
            print(
                f"flood {rate:,.0f}/s = {rate / capacity:.1f}x capacity {capacity:,.0f}/s; "
                f"{published} batches, {status.dropped} dropped, {status.replays} replays "
                f"of {status.replayed_batches} batches, {status.duplicates} duplicates; "
                f"index equal to the truth {recovered_after:.2f}s after the last frame"
            )
            time.sleep(0.6)  # a quiet-tail check after it must change nothing
            assert held_keys(plane) == resident and status.restarts == 0
    finally:
        ingestor.close()
