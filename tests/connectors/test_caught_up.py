"""`SourceStatus.caught_up` (what the gateway's /ready waits for) against the engine
simulator's real publisher and replay socket."""

from __future__ import annotations

import threading

from quillcache.connectors import ZmqSourceConfig
from tests.connectors.test_connector import ingestor, publish, publisher
from tests.online.helpers import RecordingSink, free_port, wait_for


def test_caught_up_only_once_the_replayed_buffer_is_applied() -> None:
    """An engine that published 50 batches before the gateway subscribed: the source
    is caught up only when all 50 are in the index, and from the replay alone."""
    seen_when_caught_up: list[int] = []
    sink = RecordingSink(delay_s=0.01)  # applying takes a while: caught_up must wait for it
    with publisher() as pub, ingestor(sink) as ing:
        publish(pub, 0, 50)
        status = ing.add_zmq_source(ZmqSourceConfig(0, pub.endpoint, pub.replay_endpoint))
        assert not status.caught_up

        def watch() -> None:
            wait_for(status.catching_up, what="caught up")
            seen_when_caught_up.append(len(sink.seen()))

        watcher = threading.Thread(target=watch)
        watcher.start()
        watcher.join(timeout=15)
        assert seen_when_caught_up == [50]
        assert status.replayed_to_end and not status.wire_applied and status.connected
        stats = ing.stats()
        assert (stats.sources, stats.sources_caught_up) == (1, 1)


def test_without_a_replay_socket_the_connection_is_enough() -> None:
    """Nothing can be fetched from an engine without a replay socket: its source is
    caught up once the engine's publisher has connected, before it publishes anything."""
    sink = RecordingSink()
    addr = f"tcp://127.0.0.1:{free_port()}"
    with ingestor(sink) as ing:
        status = ing.add_zmq_source(ZmqSourceConfig(1, addr, None, bind=True))
        assert not status.catching_up() and ing.stats().sources_caught_up == 0
        with publisher(endpoint=addr, replay_endpoint=None):  # connects to our bound SUB
            wait_for(lambda: status.caught_up, what="caught up on the connection")
        assert status.peer_connects == 1 and status.received == 0
        assert ing.stats().sources_caught_up == 1


def test_a_silent_replay_socket_holds_a_source_back_until_a_batch_comes() -> None:
    """Connected, but the replay socket does not answer: not caught up (what the engine
    buffered is unknown); the first batch off the wire goes through: caught up."""
    sink = RecordingSink()
    silent = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with publisher(replay_endpoint=None) as pub, ingestor(sink, quiet_tail_s=0.2) as ing:
        status = ing.add_zmq_source(ZmqSourceConfig(2, pub.endpoint, silent))
        wait_for(lambda: status.connected and status.tail_checks >= 1, what="a tail check")
        assert not status.catching_up() and status.replay_failures >= 1

        def batch_through() -> bool:
            publish(pub, pub.seq, pub.seq + 1)
            return status.caught_up

        wait_for(batch_through, what="a batch off the wire")
        assert status.wire_applied and not status.replayed_to_end
