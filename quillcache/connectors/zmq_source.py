"""One ZMQ SUB receiver per (engine endpoint, dp rank), on its own thread.

The thread creates its socket and sits in `poll` from the start: a binding SUB
gets nothing from a connecting PUB until it is blocked in poll/recv (libzmq). It polls
without a timeout: `stop()` wakes it through a pipe of its own, so an idle fleet's
receivers cost nothing (a timed poll would wake every receiver many times a second for
no event; docs/results/online.md). It does nothing but move what is ready
(`(seq, payload)` frames, up to `DRAIN_MAX` at a time) into the ingestor's bounded queue,
so it never falls behind.

What libzmq buffers per socket is outside the ingestor's byte budget, so it is kept
small: `RCVHWM` messages (the PUB drops beyond it and the gap is replayed, as for any
other loss), each at most `max_msg_bytes` (a larger one makes libzmq drop the
connection, so one frame cannot allocate unbounded memory; the reconnect triggers the
ingestor's check of the replay socket).

A socket monitor reports each new connection with the engine (it connected to us, or
we reached it again). Batches published while a connection is being set up are lost
without a gap to show it, and a reconnect may be a restarted engine: the ingestor
checks the replay socket after either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from quillcache.connectors.zap import PublisherAllowlist, networks

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
    max_msg_bytes: int = 64 << 20  # ZMQ_MAXMSGSIZE: no engine batch comes near it
    # a binding SUB admits only publishers from these addresses / CIDRs (ZAP; None: any)
    allowed_publishers: tuple[str, ...] | None = None

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


def raise_socket_limit(ctx: zmq.Context) -> None:
    """Let `ctx` hold as many sockets as libzmq allows. Its default is 1,023, and each
    engine rank takes three (the SUB, its monitor's two ends) plus a DEALER during a
    replay: 340 engines would fill it ("Too many open files" from libzmq, however many
    file descriptors the process may open). Only takes effect before the context's first
    socket (libzmq sizes its table then); a no-op after."""
    limit = min(ctx.get(zmq.SOCKET_LIMIT), 65535)
    if ctx.get(zmq.MAX_SOCKETS) < limit:
        ctx.set(zmq.MAX_SOCKETS, limit)
    # the process' own limit on open files, towards its hard limit
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        target = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


# returns how many of the frames the consumer took (the rest it dropped, counted)
Deliver = Callable[[tuple[int, int], list[tuple[int, bytes]]], int]
OnPeer = Callable[[tuple[int, int]], None]
OnMalformed = Callable[[tuple[int, int]], None]
_PEER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED


class ZmqReceiver:
    """Receives `[topic, seq, payload]` messages and hands them to `deliver`."""

    POLL_MS: int | None = None  # no timeout: stop() writes to the wake-up pipe
    # libzmq's default. Frames wait there only while this thread is busy handing over
    # the previous ones; a deeper buffer would hold, outside any budget, batches the
    # ingestor's full queue then drops anyway.
    RCVHWM = 1000
    DRAIN_MAX = 256  # frames per hand-over: one queue item, one wake-up of the applier

    def __init__(
        self,
        ctx: zmq.Context,
        config: ZmqSourceConfig,
        deliver: Deliver,
        on_peer: OnPeer | None = None,
        on_malformed: OnMalformed | None = None,
    ) -> None:
        self.ctx = ctx
        self.config = config
        self._deliver = deliver
        self._on_peer = on_peer
        self._on_malformed = on_malformed
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.malformed = 0
        self.bound_endpoint: str | None = None
        self.error: str | None = None
        self._zap: PublisherAllowlist | None = None
        # stop() writes a byte here; the thread closes the read end, stop() the write end
        self._wake_r, self._wake_w = os.pipe()
        self._stopped = False
        self._thread = threading.Thread(
            target=self._run, name=f"kv-sub-{config.worker}.{config.dp_rank}", daemon=True
        )

    @property
    def zap_domain(self) -> str:
        return f"quillcache-kv-{self.config.worker}-{self.config.dp_rank}"

    @property
    def publishers_denied(self) -> int:
        """Connections the allowlist refused (0 without one)."""
        return self._zap.denied.get(self.zap_domain, 0) if self._zap is not None else 0

    def start(self, timeout_s: float = 5.0) -> None:
        self._thread.start()
        self._ready.wait(timeout_s)
        if self.error:
            raise OSError(self.error)

    def stop(self) -> None:
        self._stop.set()
        if not self._stopped:
            self._stopped = True
            with contextlib.suppress(OSError):  # the thread is gone: it closed the read end
                os.write(self._wake_w, b"x")
            os.close(self._wake_w)
        if not self._thread.is_alive() and self._thread.ident is None:
            os.close(self._wake_r)  # never started: nobody else closes it
        elif self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        cfg = self.config
        sock = self.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_msg_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        if cfg.bind and cfg.allowed_publishers is not None:
            # before bind: every connection to the socket then goes through the handler
            zap = PublisherAllowlist.for_context(self.ctx)
            zap.allow(self.zap_domain, networks(cfg.allowed_publishers))
            self._zap = zap
            sock.setsockopt(zmq.ZAP_DOMAIN, self.zap_domain.encode())
        # before bind/connect, or the first connection may be set up unseen
        monitor = sock.get_monitor_socket(_PEER_EVENTS)
        try:
            if cfg.bind:
                sock.bind(cfg.endpoint)
                self.bound_endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                sock.connect(cfg.endpoint)
        except zmq.ZMQError as exc:
            self.error = f"cannot {'bind' if cfg.bind else 'connect'} {cfg.endpoint}: {exc}"
            self._ready.set()
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            os.close(self._wake_r)
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(self.POLL_MS))
                if monitor in ready:
                    self._drain_monitor(monitor)
                if sock in ready:
                    self._drain(sock)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            os.close(self._wake_r)

    def _drain_monitor(self, monitor: zmq.Socket) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & _PEER_EVENTS and self._on_peer is not None:
                self._on_peer(self.config.key)

    def _drain(self, sock: zmq.Socket) -> None:
        """Everything ready, before polling again."""
        cfg = self.config
        more = True
        while more:
            batch: list[tuple[int, bytes]] = []
            while len(batch) < self.DRAIN_MAX:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    more = False
                    break
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.malformed += 1
                    if self._on_malformed is not None:
                        self._on_malformed(cfg.key)
                    log.warning(
                        "kv events from %s: malformed message (%d frames), ignored",
                        cfg.endpoint,
                        len(frames),
                    )
                    continue
                batch.append((int.from_bytes(frames[1], "big"), frames[2]))
            if batch:
                self._deliver(cfg.key, batch)
