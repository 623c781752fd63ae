"""KV-event publishing as vLLM does it: a PUB socket plus a ROUTER replay socket.

The PUB binds when the endpoint has `*`, `::` or is ipc/inproc, else it connects (the
consumer binds), exactly vLLM's rule. Every batch is kept in a ring of `buffer_steps`
for replay. The replay socket is served by its own thread, so a replay never waits
for the event loop; the publishers of many engines in one process (`engine-sim
--engines N`) share one such thread (`ReplayHub`: one poll over every ROUTER socket,
not a thread per engine waking twenty times a second). Fault injection for tests:
`drop_next(n)` skips sending the next n batches on the PUB (they stay replayable),
`drop_next(n, forget=True)` also keeps them out of the replay buffer (an unreplayable
gap).
"""

from __future__ import annotations

import collections
import logging
import threading
import time

import zmq

from quillcache.connectors.replay import END_SEQ
from quillcache.connectors.zmq_source import engine_binds
from quillcache.events.encode import frame

log = logging.getLogger(__name__)


def _bind(sock: zmq.Socket, endpoint: str, retry_s: float = 2.0) -> None:
    """Bind, retrying briefly: a restarted engine's old socket may still hold the port
    for a moment (libzmq closes sockets asynchronously)."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            sock.bind(endpoint)
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class KvEventPublisher:
    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        legacy_replay: bool = False,  # vLLM < 0.26, SGLang < 0.5.22: [b"", seq, payload]
        end_marker_topic: bool = True,  # SGLang < 0.5.22 ends with [b"", END_SEQ, b""]
        ctx: zmq.Context | None = None,
        replay_hub: ReplayHub | None = None,  # None: a thread of its own
    ) -> None:
        self.ctx = ctx or zmq.Context.instance()
        self.topic = topic.encode()
        self.legacy_replay = legacy_replay
        self.end_marker_topic = end_marker_topic
        self.seq = 0
        self.published = 0
        self.dropped = 0
        self._drop_next = 0
        self._forget = False
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._pub = self.ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.binds = engine_binds(endpoint)
        if self.binds:
            _bind(self._pub, endpoint)
            self.endpoint = self._resolved(self._pub)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self.replay_endpoint: str | None = None
        self._hub: ReplayHub | None = None
        if replay_endpoint:
            router = self.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            _bind(router, replay_endpoint)  # the replay socket always binds
            self.replay_endpoint = self._resolved(router)
            self._hub = replay_hub or ReplayHub()
            self._hub.add(router, self)
            if replay_hub is None:
                self._hub.start()
        self._own_hub = replay_hub is None

    @staticmethod
    def _resolved(sock: zmq.Socket) -> str:
        """The concrete address (port 0 and `*` resolved) to advertise."""
        addr = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        return addr.replace("0.0.0.0", "127.0.0.1")

    def drop_next(self, count: int, *, forget: bool = False) -> None:
        with self._lock:
            self._drop_next = count
            self._forget = forget

    def publish(self, payload: bytes) -> int:
        """Send one event batch; returns its seq. Call from one thread (the event loop)."""
        with self._lock:
            seq = self.seq
            self.seq += 1
            dropping = self._drop_next > 0
            if dropping:
                self._drop_next -= 1
                self.dropped += 1
            if not (dropping and self._forget):
                self._buffer.append((seq, payload))
        if not dropping:
            try:
                self._pub.send_multipart(frame(self.topic, seq, payload), zmq.NOBLOCK)
                self.published += 1
            except zmq.Again:  # HWM reached: the subscriber's gap logic replays it
                self.dropped += 1
        return seq

    def answer_replay(self, router: zmq.Socket) -> None:
        """Answer one request waiting on this publisher's ROUTER socket (the hub's thread)."""
        frames = router.recv_multipart()
        if len(frames) < 3 or len(frames[2]) != 8:
            log.warning("replay: malformed request of %d frames ignored", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        with self._lock:
            batches = [(s, p) for s, p in self._buffer if s >= start]
        for seq, payload in batches:
            seq_b = seq.to_bytes(8, "big")
            if self.legacy_replay:
                router.send_multipart([identity, b"", seq_b, payload])
            else:
                router.send_multipart([identity, b"", self.topic, seq_b, payload])
        end = END_SEQ.to_bytes(8, "big")
        if self.end_marker_topic:
            router.send_multipart([identity, b"", b"", end, b""])
        else:
            router.send_multipart([identity, b"", end, b""])

    def close(self) -> None:
        if self._hub is not None and self._own_hub:
            self._hub.close()
        self._pub.close(0)


class ReplayHub:
    """One thread answering the replay requests of any number of publishers: a single
    poll over their ROUTER sockets. Sockets added before `start()` are served from the
    first poll; `close()` stops the thread and closes every socket it holds."""

    POLL_MS = 100  # how soon `close()` is noticed; requests wake the poll at once

    def __init__(self) -> None:
        self._sockets: dict[zmq.Socket, KvEventPublisher] = {}
        self._lock = threading.Lock()
        self._changed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-replay", daemon=True)

    def add(self, router: zmq.Socket, publisher: KvEventPublisher) -> None:
        with self._lock:
            self._sockets[router] = publisher
            self._changed = True

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        owners: dict[zmq.Socket, KvEventPublisher] = {}
        try:
            while not self._stop.is_set():
                if self._changed:
                    with self._lock:
                        for sock in self._sockets.keys() - owners.keys():
                            poller.register(sock, zmq.POLLIN)
                        owners = dict(self._sockets)
                        self._changed = False
                for sock, _ in poller.poll(self.POLL_MS):
                    try:
                        owners[sock].answer_replay(sock)
                    except zmq.ZMQError as exc:  # one peer's trouble stops no other answer
                        log.warning("replay: %s", exc)
        finally:
            with self._lock:
                for sock in self._sockets:
                    sock.close(0)

    def close(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started: its last act closes the sockets
            self._thread.join(timeout=1.0)
        else:
            with self._lock:
                for sock in self._sockets:
                    sock.close(0)
