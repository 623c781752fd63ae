"""One ZMQ SUB receiver per (engine endpoint, dp rank), on its own thread.

The thread creates its socket and sits in `poll` from the start: a binding SUB
gets nothing from a connecting PUB until it is blocked in poll/recv (libzmq), and a
short poll timeout lets it notice `stop()`. It does nothing but move
`(seq, payload)` into the ingestor's bounded queue, so it never falls behind.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ZmqSourceConfig:
    """Where one engine rank publishes. `bind=True` when the engine connects to us."""

    worker: int
    endpoint: str  # the PUB endpoint (we connect) or our address (we bind)
    replay_endpoint: str | None = None
    dp_rank: int = 0
    topic: str = ""
    bind: bool = False

    @property
    def key(self) -> tuple[int, int]:
        return (self.worker, self.dp_rank)


def engine_binds(endpoint: str) -> bool:
    """vLLM's rule: its PUB binds for `*`, `::`, ipc:// and inproc://, else it connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def with_rank(endpoint: str, dp_rank: int) -> str:
    """Rank r of an engine publishes on the base port + r."""
    if dp_rank == 0:
        return endpoint
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + dp_rank}"


Deliver = Callable[[tuple[int, int], int, bytes], None]


class ZmqReceiver:
    """Receives `[topic, seq, payload]` messages and hands them to `deliver`."""

    POLL_MS = 50

    def __init__(self, ctx: zmq.Context, config: ZmqSourceConfig, deliver: Deliver) -> None:
        self.ctx = ctx
        self.config = config
        self._deliver = deliver
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.malformed = 0
        self.bound_endpoint: str | None = None
        self.error: str | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"kv-sub-{config.worker}.{config.dp_rank}", daemon=True
        )

    def start(self, timeout_s: float = 5.0) -> None:
        self._thread.start()
        self._ready.wait(timeout_s)
        if self.error:
            raise OSError(self.error)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        cfg = self.config
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        try:
            if cfg.bind:
                sock.bind(cfg.endpoint)
                self.bound_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                sock.connect(cfg.endpoint)
        except zmq.ZMQError as exc:
            self.error = f"cannot {'bind' if cfg.bind else 'connect'} {cfg.endpoint}: {exc}"
            self._ready.set()
            sock.close(0)
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(self.POLL_MS):
                    continue
                while True:  # drain everything ready before polling again
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3 or len(frames[1]) != 8:
                        self.malformed += 1
                        log.warning(
                            "kv events from %s: malformed message (%d frames), ignored",
                            cfg.endpoint,
                            len(frames),
                        )
                        continue
                    self._deliver(cfg.key, int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sock.close(0)
