"""Who may publish to a KV-event socket the gateway binds: only the allowlist's addresses
(real ZMQ: a PUB connecting from 127.0.0.2 to a SUB bound on 127.0.0.1)."""

from __future__ import annotations

import time

import pytest
import zmq

from quillcache.connectors import EventIngestor, ZmqSourceConfig
from quillcache.events.encode import AllBlocksCleared, encode_batch, frame
from tests.online.helpers import RecordingSink, wait_for


def publish_from(source_ip: str, endpoint: str, count: int) -> None:
    """A publisher on `source_ip` (libzmq's `tcp://SOURCE:0;DEST` form) sending `count`
    batches, numbered from 0, after its connection had time to be set up."""
    ctx = zmq.Context()  # its own context: the gateway's ZAP handler must not see it
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    host_port = endpoint.removeprefix("tcp://")
    pub.connect(f"tcp://{source_ip}:0;{host_port}")
    time.sleep(0.5)
    for i in range(count):
        pub.send_multipart(frame(b"", i, encode_batch([AllBlocksCleared()], ts=float(i))))
    time.sleep(0.3)
    pub.close(0)
    ctx.term()


@pytest.mark.parametrize(
    ("allowed", "source", "admitted"),
    [
        (("127.0.0.1",), "127.0.0.2", False),
        (("127.0.0.1",), "127.0.0.1", True),
        (("127.0.0.0/8",), "127.0.0.2", True),  # a network, not only exact addresses
        (None, "127.0.0.2", True),  # no allowlist: anyone (a connecting SUB needs none)
    ],
)
def test_only_allowed_publishers_reach_the_ingest(
    allowed: tuple[str, ...] | None, source: str, admitted: bool
) -> None:
    sink = RecordingSink()
    ingestor = EventIngestor(sink, replay_timeout_s=0.5)
    try:
        config = ZmqSourceConfig(7, "tcp://127.0.0.1:*", bind=True, allowed_publishers=allowed)
        ingestor.add_zmq_source(config)
        endpoint = ingestor.bound_endpoint(7)
        assert endpoint is not None
        publish_from(source, endpoint, 5)
        if admitted:
            wait_for(lambda: len(sink.seen(7)) == 5, what="the admitted publisher's batches")
        else:
            time.sleep(0.5)
            assert sink.seen(7) == []
            assert ingestor.stats().publishers_denied >= 1
            per_source = {(s["worker"], s["dp_rank"]): s for s in ingestor.stats().per_source}
            assert per_source[(7, 0)]["publishers_denied"] >= 1
    finally:
        ingestor.close()
