"""The ZMQ connector against the engine simulator's real publisher and replay socket."""

from __future__ import annotations

import collections.abc
import contextlib
import time

import pytest
import zmq

from quillcache.connectors import EventIngestor, ZmqSourceConfig
from quillcache.enginesim.publisher import KvEventPublisher
from quillcache.events.encode import AllBlocksCleared, encode_batch
from tests.online.helpers import RecordingSink, free_port, wait_for


def batch(i: int) -> bytes:
    return encode_batch([AllBlocksCleared()], ts=float(i), dp_rank=0)


@contextlib.contextmanager
def publisher(**kw: object) -> collections.abc.Iterator[KvEventPublisher]:
    pub = KvEventPublisher(
        kw.pop("endpoint", "tcp://127.0.0.1:*"),  # type: ignore[arg-type]
        kw.pop("replay_endpoint", "tcp://127.0.0.1:*"),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )
    try:
        yield pub
    finally:
        pub.close()


@contextlib.contextmanager
def ingestor(sink: RecordingSink, **kw: object) -> collections.abc.Iterator[EventIngestor]:
    ing = EventIngestor(sink, replay_timeout_s=1.0, **kw)  # type: ignore[arg-type]
    try:
        yield ing
    finally:
        ing.close()


def publish(pub: KvEventPublisher, start: int, stop: int) -> None:
    for i in range(start, stop):
        pub.publish(batch(i))


@pytest.mark.parametrize("legacy", [False, True], ids=["topic-layout", "legacy-layout"])
def test_late_subscriber_catches_up_and_dropped_batches_are_replayed(legacy: bool) -> None:
    sink = RecordingSink()
    with publisher(legacy_replay=legacy, topic="kv") as pub, ingestor(sink) as ing:
        publish(pub, 0, 10)  # before anyone listens: only the replay has them
        ing.add_zmq_source(ZmqSourceConfig(0, pub.endpoint, pub.replay_endpoint, topic="kv"))
        wait_for(lambda: len(sink.seen()) == 10, what="initial replay")
        wait_for(lambda: pub.published and ing.sources[(0, 0)].replays, what="sync")
        time.sleep(0.2)  # the subscription must reach the PUB before live batches count
        publish(pub, 10, 20)
        pub.drop_next(5)  # 20..24 never go out live
        publish(pub, 20, 40)
        wait_for(lambda: len(sink.seen()) == 40, what="all 40 batches")
        assert sink.seen() == [float(i) for i in range(40)]
        status = ing.sources[(0, 0)]
        assert status.gaps >= 1 and status.replays >= 2
        assert not sink.clears and not status.stale


def test_unreplayable_gap_marks_the_source_stale_then_rebuilt() -> None:
    sink = RecordingSink()
    with publisher() as pub, ingestor(sink, stale_rebuild_s=0.5) as ing:
        ing.add_zmq_source(ZmqSourceConfig(3, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: ing.sources[(3, 0)].replays, what="sync")
        time.sleep(0.2)
        publish(pub, 0, 5)
        wait_for(lambda: len(sink.seen(3)) == 5, what="first batches")
        pub.drop_next(3, forget=True)  # 5..7 are gone for good
        publish(pub, 5, 12)
        wait_for(lambda: sink.stale.get((3, 0)) is True, what="stale mark")
        assert (3, 0) in sink.clears
        wait_for(lambda: sink.seen(3) == [8.0, 9.0, 10.0, 11.0], what="rebuild from 8")
        wait_for(lambda: sink.stale.get((3, 0)) is False, timeout=5, what="rebuilt")
        assert ing.stats().stale_marks == 1


def test_engine_restart_clears_the_source_and_starts_over() -> None:
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink) as ing:
        # The engine connects (no `*`): we bind, as with vLLM on a loopback endpoint.
        ing.add_zmq_source(ZmqSourceConfig(1, addr, replay, bind=True))
        with publisher(endpoint=addr, replay_endpoint=replay) as pub:
            assert not pub.binds
            publish(pub, 0, 30)
            wait_for(lambda: len(sink.seen(1)) == 30, what="first life")
        with publisher(endpoint=addr, replay_endpoint=replay) as pub2:
            # seq 0.. again, new content; the first ones may be lost while it connects,
            # which the replay fills in once a later one shows the restart.
            publish(pub2, 100, 110)
            time.sleep(0.3)
            publish(pub2, 110, 115)
            expected = [float(i) for i in range(100, 115)]
            wait_for(lambda: sink.seen(1) == expected, what="second life")
        assert ing.sources[(1, 0)].restarts == 1
        assert sink.clears == [(1, 0)]


def test_batches_lost_while_the_engine_connects_are_replayed() -> None:
    """A connecting PUB drops what it sends before the connection is up, and nothing
    after it shows a gap: the new connection itself triggers the quiet-tail check."""
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink, quiet_tail_s=0.3) as ing:
        ing.add_zmq_source(ZmqSourceConfig(1, addr, bind=True, replay_endpoint=None))
        with publisher(endpoint=addr) as pub:
            ing.sources[(1, 0)].replay_endpoint = pub.replay_endpoint
            pub.drop_next(30)  # none goes out live; the replay buffer has them all
            publish(pub, 0, 30)
            wait_for(lambda: len(sink.seen(1)) == 30, what="the lost batches")
            assert sink.seen(1) == [float(i) for i in range(30)]
            status = ing.sources[(1, 0)]
            assert status.peer_connects == 1 and status.tail_replayed_batches == 30


@pytest.mark.parametrize("new_life", [0, 4], ids=["silent-new-life", "lost-new-life"])
def test_a_restarted_engine_that_goes_quiet_is_cleared(new_life: int) -> None:
    """The engine restarts and none of its new batches reach us (there are none, or all
    are lost while it connects): the reconnect's probe still finds the restart."""
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink, quiet_tail_s=0.3) as ing:
        ing.add_zmq_source(ZmqSourceConfig(1, addr, replay, bind=True))
        with publisher(endpoint=addr, replay_endpoint=replay) as pub:
            wait_for(lambda: ing.sources[(1, 0)].peer_connects == 1, what="first connection")
            time.sleep(0.2)
            publish(pub, 0, 10)
            wait_for(lambda: len(sink.seen(1)) == 10, what="first life")
        with publisher(endpoint=addr, replay_endpoint=replay) as pub2:
            pub2.drop_next(new_life)
            publish(pub2, 100, 100 + new_life)
            expected = [float(i) for i in range(100, 100 + new_life)]
            wait_for(lambda: sink.clears == [(1, 0)], what="the restart")
            wait_for(lambda: sink.seen(1) == expected, what="the new life")
        status = ing.sources[(1, 0)]
        assert status.restarts == 1 and not status.stale


def test_a_reconnect_to_a_healthy_engine_keeps_its_residency() -> None:
    """Re-adding the source makes a new connection; the engine still holds our last
    batch with the same bytes, so nothing is cleared and only newer batches apply."""
    sink = RecordingSink()
    with publisher() as pub, ingestor(sink, quiet_tail_s=0.3) as ing:
        config = ZmqSourceConfig(2, pub.endpoint, pub.replay_endpoint)
        ing.add_zmq_source(config)
        wait_for(lambda: ing.sources[(2, 0)].replays, what="sync")
        time.sleep(0.2)
        publish(pub, 0, 8)
        wait_for(lambda: len(sink.seen(2)) == 8, what="first batches")
        wait_for(lambda: not ing.sources[(2, 0)].tail_pending, what="quiet check")
        ing.add_zmq_source(config)  # a new receiver: a new connection
        pub.drop_next(2)
        publish(pub, 8, 10)
        wait_for(lambda: len(sink.seen(2)) == 10, what="the batches lost meanwhile")
        wait_for(lambda: not ing.sources[(2, 0)].tail_pending, what="quiet check")
        assert sink.seen(2) == [float(i) for i in range(10)]
        assert not sink.clears and ing.sources[(2, 0)].restarts == 0


@pytest.mark.parametrize("restarted", [False, True], ids=["healthy-engine", "restarted-engine"])
def test_after_a_gateway_restart_the_probe_tells_a_restarted_engine_apart(restarted: bool) -> None:
    """Resuming from a persisted seq with no digest: a healthy engine holds that seq,
    a restarted one (fewer batches in its new life) does not."""
    sink = RecordingSink()
    with publisher() as pub:
        publish(pub, 0, 3 if restarted else 12)
        with ingestor(sink, quiet_tail_s=0.3) as ing:
            config = ZmqSourceConfig(4, pub.endpoint, pub.replay_endpoint)
            status = ing.add_zmq_source(config, resume_from=9)  # the old life reached seq 9
            wait_for(lambda: status.tail_checks >= 1, what="the probe after connecting")
            assert status.peer_connects == 1
            if restarted:
                assert sink.clears == [(4, 0)] and sink.seen(4) == [0.0, 1.0, 2.0]
                assert status.restarts == 1
            else:
                assert not sink.clears and sink.seen(4) == [10.0, 11.0]


@pytest.mark.parametrize(
    "bounds",
    [{"queue_size": 4}, {"queue_bytes": 3 * len(batch(0))}],
    ids=["bounded-in-batches", "bounded-in-bytes"],
)
def test_a_full_queue_drops_then_replays_without_losing_order(bounds: dict[str, int]) -> None:
    sink = RecordingSink(delay_s=0.005)  # a slow index
    with publisher() as pub, ingestor(sink, drain_batch=2, **bounds) as ing:
        ing.add_zmq_source(ZmqSourceConfig(0, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: ing.sources[(0, 0)].replays, what="sync")
        time.sleep(0.2)
        publish(pub, 0, 300)
        wait_for(lambda: len(sink.seen()) == 300, timeout=20, what="all batches")
        assert sink.seen() == [float(i) for i in range(300)]
        assert ing.stats().dropped > 0  # the flood did overflow the bounded queue


def test_malformed_messages_are_counted_not_fatal() -> None:
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink) as ing:
        ing.add_zmq_source(ZmqSourceConfig(0, addr, bind=True))
        ctx = zmq.Context.instance()
        rogue = ctx.socket(zmq.PUB)
        rogue.connect(addr)
        try:
            time.sleep(0.3)
            rogue.send_multipart([b"", b"\x00"])  # 2 frames
            rogue.send_multipart([b"", (0).to_bytes(8, "big"), b"\xc1 not msgpack"])
            rogue.send_multipart([b"", (1).to_bytes(8, "big"), batch(1)])
            wait_for(lambda: sink.seen() == [1.0], what="the good batch")
            status = ing.sources[(0, 0)]
            assert status.decode_errors == 1
            assert ing._receivers[(0, 0)].malformed == 1 and status.malformed == 1
        finally:
            rogue.close(0)


def test_a_lost_tail_is_replayed_once_the_source_goes_quiet() -> None:
    """The last batches are lost and nothing follows to reveal the gap: the quiet-tail
    check finds them; then, with no new traffic, it does not ask again."""
    sink = RecordingSink()
    with publisher() as pub, ingestor(sink, quiet_tail_s=0.3) as ing:
        ing.add_zmq_source(ZmqSourceConfig(0, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: ing.sources[(0, 0)].replays, what="sync")
        time.sleep(0.2)
        publish(pub, 0, 10)
        wait_for(lambda: len(sink.seen()) == 10, what="the live batches")
        status = ing.sources[(0, 0)]
        gaps = status.gaps
        pub.drop_next(3)  # 10..12 never go out live, and the engine then goes quiet
        publish(pub, 10, 13)
        wait_for(lambda: len(sink.seen()) == 13, what="the lost tail")
        assert sink.seen() == [float(i) for i in range(13)]
        assert status.gaps == gaps  # no later seq revealed it: the quiet check did
        assert status.tail_replayed_batches == 3 and ing.stats().tail_replayed_batches == 3
        checks, replays = status.tail_checks, status.replays
        time.sleep(1.0)  # > 3 quiet periods without traffic: no more asking
        assert (status.tail_checks, status.replays) == (checks, replays)


def test_a_request_whose_events_are_all_lost_is_checked_too() -> None:
    """Nothing at all arrives after a request (every batch lost): `expect_events` (the
    gateway calls it when a request to that worker ends) arms the quiet-tail check."""
    sink = RecordingSink()
    with publisher() as pub, ingestor(sink, quiet_tail_s=0.3) as ing:
        ing.add_zmq_source(ZmqSourceConfig(0, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: ing.sources[(0, 0)].replays, what="sync")
        time.sleep(0.2)
        publish(pub, 0, 4)
        wait_for(lambda: len(sink.seen()) == 4, what="the live batches")
        status = ing.sources[(0, 0)]
        wait_for(lambda: status.tail_checks >= 1, what="the first (empty) tail check")
        assert status.tail_replayed_batches == 0  # up to date: an empty answer
        pub.drop_next(2)
        publish(pub, 4, 6)  # both lost: nothing reaches the ingestor
        assert not status.tail_pending
        ing.expect_events(0)
        wait_for(lambda: len(sink.seen()) == 6, what="the lost request's batches")
        assert sink.seen() == [float(i) for i in range(6)]
        assert status.tail_replayed_batches == 2


def test_a_forged_seq_far_ahead_is_dropped_and_counted_not_a_restart() -> None:
    """A frame numbered far beyond anything the engine published: the replay before it
    ends first, so it is dropped (counted), and the real stream resuming below it (the
    wire's order turning back) is verified as the same engine: nothing is cleared."""
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink, quiet_tail_s=0.3) as ing:
        ing.add_zmq_source(ZmqSourceConfig(1, addr, replay, bind=True))
        with publisher(endpoint=addr, replay_endpoint=replay) as pub:
            status = ing.sources[(1, 0)]
            wait_for(lambda: status.peer_connects == 1, what="the engine's connection")
            time.sleep(0.2)
            publish(pub, 0, 10)
            wait_for(lambda: len(sink.seen(1)) == 10, what="first batches")
            rogue = zmq.Context.instance().socket(zmq.PUB)
            rogue.connect(addr)
            try:
                time.sleep(0.3)
                rogue.send_multipart([b"", (10**12).to_bytes(8, "big"), batch(999)])
                wait_for(lambda: status.implausible_seqs == 1, what="the forged seq")
            finally:
                rogue.close(0)
            publish(pub, 10, 15)
            wait_for(lambda: len(sink.seen(1)) == 15, what="the real stream")
            assert sink.seen(1) == [float(i) for i in range(15)]
            assert not sink.clears and not status.stale
            assert status.restarts == 0 and status.restart_suspects == 1
            assert ing.stats().implausible_seqs == 1


def test_malformed_frames_are_counted_per_source() -> None:
    sink = RecordingSink()
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    with ingestor(sink) as ing:
        for worker, addr in enumerate(addrs):
            ing.add_zmq_source(ZmqSourceConfig(worker, addr, bind=True))
        rogue = zmq.Context.instance().socket(zmq.PUB)
        rogue.connect(addrs[1])
        try:
            time.sleep(0.3)
            rogue.send_multipart([b"", b"\x00"])  # 2 frames
            rogue.send_multipart([b"", b"\x00\x01", b"x"])  # a 2-byte seq frame
            rogue.send_multipart([b"", (0).to_bytes(8, "big"), batch(0)])
            wait_for(lambda: sink.seen(1) == [0.0], what="the good batch")
        finally:
            rogue.close(0)
        assert ing.sources[(1, 0)].as_dict()["malformed"] == 2
        assert ing.sources[(0, 0)].as_dict()["malformed"] == 0
        rows = {(r["worker"], r["dp_rank"]): r for r in ing.stats().per_source}
        assert rows[(1, 0)]["malformed"] == 2 and rows[(0, 0)]["malformed"] == 0
        assert ing.stats().malformed == 2


def test_a_loss_beyond_the_buffer_is_rebuilt_once_after_the_overload_not_per_gap() -> None:
    """The engine's replay buffer holds 40 batches; a slow sink and a 20-batch queue make
    the gateway drop most of 3,000: the source is marked stale once, its queued batches
    skipped, and rebuilt once from the buffer when the overload is over; what it holds
    then is exactly the buffer's last batches, in order."""
    sink = RecordingSink(delay_s=0.002)
    with (
        publisher(buffer_steps=40) as pub,
        ingestor(sink, queue_size=20, quiet_tail_s=0.3) as ing,
    ):
        ing.add_zmq_source(ZmqSourceConfig(5, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: ing.sources[(5, 0)].replays, what="sync")
        time.sleep(0.3)
        publish(pub, 0, 3000)
        status = ing.sources[(5, 0)]
        wait_for(lambda: status.last_seq == 2999, timeout=20, what="caught up")
        time.sleep(0.6)  # a quiet-tail check after it must change nothing
        assert status.stale_marks == 1 and status.rebuilds == 1, status.as_dict()
        assert status.restarts == 0 and status.skipped_while_lost > 0
        after_clear = sink.seen(5)[-40:]
        assert after_clear == [float(i) for i in range(2960, 3000)]
