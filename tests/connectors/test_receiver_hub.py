"""Every ZMQ receiver of an ingestor served by one thread (`ZmqHub`), against the engine
simulator's real publishers: each source's batches still arrive whole and in order, a
source stopped or replaced leaves the others alone, and an idle fleet costs nothing."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quillcache.connectors import ZmqSourceConfig
from quillcache.enginesim.publisher import KvEventPublisher, ReplayHub
from tests.connectors.test_connector import ingestor, publish
from tests.online.helpers import RecordingSink, free_port, wait_for

SOURCES = 40


@contextlib.contextmanager
def fleet(n: int) -> Iterator[list[KvEventPublisher]]:
    """`n` publishers (one replay thread for all, as `engine-sim --engines N`)."""
    hub = ReplayHub()
    pubs = [KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_hub=hub)]
    try:
        pubs += [
            KvEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", replay_hub=hub)
            for _ in range(n - 1)
        ]
        hub.start()
        yield pubs
    finally:
        for p in pubs:
            p.close()
        hub.close()


def receiver_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kv-sub")]


def thread_cpu_s(thread: threading.Thread) -> float:
    assert thread.native_id is not None
    text = Path(f"/proc/self/task/{thread.native_id}/stat").read_text()
    stat = text.rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


def test_one_thread_receives_every_source_in_order() -> None:
    """40 sources, one receiver thread; each source's 30 batches (10 replayed from
    before the subscription, 20 live, interleaved across sources) arrive in order."""
    sink = RecordingSink()
    before = len(receiver_threads())
    with fleet(SOURCES) as pubs, ingestor(sink) as ing:
        for w, pub in enumerate(pubs):
            publish(pub, 0, 10)
            ing.add_zmq_source(ZmqSourceConfig(w, pub.endpoint, pub.replay_endpoint))
        assert len(receiver_threads()) - before == 1
        wait_for(lambda: all(len(sink.seen(w)) == 10 for w in range(SOURCES)), what="the replays")
        time.sleep(0.3)  # the subscriptions must reach the publishers
        for i in range(10, 30):
            for pub in pubs:
                publish(pub, i, i + 1)
        wait_for(lambda: all(len(sink.seen(w)) == 30 for w in range(SOURCES)), what="every batch")
        for w in range(SOURCES):
            assert sink.seen(w) == [float(i) for i in range(30)]
        assert ing.stats().dropped == 0 and not sink.clears


def test_a_stopped_source_leaves_the_others_served_and_can_come_back() -> None:
    sink = RecordingSink()
    with fleet(3) as pubs, ingestor(sink) as ing:
        for w, pub in enumerate(pubs):
            ing.add_zmq_source(ZmqSourceConfig(w, pub.endpoint, pub.replay_endpoint))
        wait_for(lambda: all(ing.sources[(w, 0)].caught_up for w in range(3)), what="caught up")
        time.sleep(0.3)
        ing.remove_worker(1)
        for pub in pubs:
            publish(pub, 0, 5)
        wait_for(lambda: len(sink.seen(0)) == 5 and len(sink.seen(2)) == 5, what="0 and 2")
        time.sleep(0.2)
        assert sink.seen(1) == []  # its socket is closed: nothing of it reaches the queue
        # added again (a new socket on the same hub): its replay brings what it missed
        ing.add_zmq_source(ZmqSourceConfig(1, pubs[1].endpoint, pubs[1].replay_endpoint))
        wait_for(lambda: len(sink.seen(1)) == 5, what="1 again, from its replay")
        time.sleep(0.3)
        publish(pubs[1], 5, 8)
        wait_for(lambda: sink.seen(1) == [float(i) for i in range(8)], what="1 live")


def test_a_source_that_cannot_bind_fails_alone() -> None:
    """`add_zmq_source` raises for an address in use; the hub goes on serving the rest."""
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    with fleet(1) as pubs, ingestor(sink) as ing:
        ing.add_zmq_source(ZmqSourceConfig(5, addr, None, bind=True))
        with pytest.raises(OSError, match="cannot bind"):
            ing.add_zmq_source(ZmqSourceConfig(6, addr, None, bind=True))
        ing.add_zmq_source(ZmqSourceConfig(0, pubs[0].endpoint, pubs[0].replay_endpoint))
        wait_for(lambda: ing.sources[(0, 0)].caught_up, what="caught up")
        time.sleep(0.3)
        publish(pubs[0], 0, 4)
        wait_for(lambda: sink.seen(0) == [0.0, 1.0, 2.0, 3.0], what="the other source")


def test_a_bad_allowlist_entry_is_an_error_at_once_and_opens_nothing() -> None:
    """An allowlist entry that is no address: `OSError` naming it, straight away (no
    socket left open), and the hub serves the next source."""
    sink = RecordingSink()
    with fleet(1) as pubs, ingestor(sink) as ing:
        bad = ZmqSourceConfig(
            4, "tcp://127.0.0.1:*", None, bind=True, allowed_publishers=("not-an-ip",)
        )
        started = time.monotonic()
        with pytest.raises(OSError, match="'not-an-ip' is not an IP address"):
            ing.add_zmq_source(bad)
        assert time.monotonic() - started < 1.0
        assert ing._hub.receivers == 0
        ing.add_zmq_source(ZmqSourceConfig(0, pubs[0].endpoint, pubs[0].replay_endpoint))
        wait_for(lambda: ing.sources[(0, 0)].caught_up, what="caught up")
        assert ing._hub.receivers == 1


def test_an_idle_fleet_never_wakes_the_receiver() -> None:
    """No timeout in the wait: 40 quiet sources cost the receiver thread no CPU."""
    sink = RecordingSink()
    with fleet(SOURCES) as pubs, ingestor(sink, quiet_tail_s=0) as ing:
        for w, pub in enumerate(pubs):
            ing.add_zmq_source(ZmqSourceConfig(w, pub.endpoint, pub.replay_endpoint))
        wait_for(
            lambda: all(s.caught_up for s in ing.sources.values()), what="every source caught up"
        )
        time.sleep(0.5)  # connections settle
        (thread,) = [t for t in receiver_threads() if t.is_alive()]
        cpu = thread_cpu_s(thread)
        time.sleep(1.0)
        assert thread_cpu_s(thread) - cpu <= 0.02
