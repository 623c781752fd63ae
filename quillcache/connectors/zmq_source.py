"""ZMQ SUB receivers, one per (engine endpoint, dp rank), all served by one thread.

One thread (`ZmqHub`, one per ingestor) waits in an epoll over every receiver's socket
(libzmq's `ZMQ_FD`, and its monitor's) plus a wake-up pipe, without a timeout, and
services only the sockets that are ready: what a wake-up costs depends on the sources
with something to read, not on how many there are. (A thread per source made every
event batch a thread switch and a GIL hand-over, and 256 threads contended for the GIL
under load; one `zmq.Poller` over every socket costs O(sockets) per wake-up, since
libzmq's `zmq_poll` reads each socket's state on every call.) Sockets are created, read
and closed on that thread only; `ZmqReceiver.start`/`stop` hand it commands through the
pipe and wait for them. An idle fleet costs nothing: nothing wakes the thread.

`ZMQ_FD` says only that the socket's state may have changed: a ready socket is read
until libzmq says it has nothing (`EAGAIN`), after which a new message signals the
descriptor again. At most `DRAIN_MAX` frames of one socket are taken per turn, then the
next ready socket's: a flood on one source cannot hold up the others (their buffers
would overflow meanwhile), and a socket still holding frames is served again before the
thread waits. Each receiver does nothing but move what is ready (`(seq, payload)`
frames) into the ingestor's bounded queue, so it never falls behind. Only the hub's
thread delivers, so each source's batches reach the queue in the publisher's order.

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

import collections
import concurrent.futures
import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import zmq
from zmq.utils.monitor import recv_monitor_message

from quillcache.connectors.zap import PublisherAllowlist, networks

log = logging.getLogger(__name__)
_T = TypeVar("_T")


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


class ZmqHub:
    """The one thread that serves every `ZmqReceiver` of an ingestor (module docstring).

    Its thread starts with the first receiver. Everything that touches a socket runs on
    it: `call` hands it a function through the wake-up pipe and waits for the result.
    `close` it before terminating its context: the thread waits in epoll, not in libzmq,
    so it does not see the context end (its sockets would hold `term` up)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.ctx = ctx
        self._lock = threading.Lock()
        self._commands: collections.deque[
            tuple[Callable[[], object], concurrent.futures.Future[object]]
        ] = collections.deque()
        self._by_fd: dict[int, tuple[ZmqReceiver, bool]] = {}  # fd -> (receiver, monitor?)
        self._receivers: set[ZmqReceiver] = set()
        self._fresh: list[ZmqReceiver] = []  # opened since the thread last waited
        self._epoll: select.epoll | None = None
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._closed = False

    @property
    def receivers(self) -> int:
        """Receivers with an open socket."""
        return len(self._receivers)

    def on_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def call(self, fn: Callable[[], _T], timeout_s: float) -> concurrent.futures.Future[_T]:
        """Run `fn` on the hub's thread; its future, resolved within `timeout_s` unless
        the thread is stuck (then not done). Runs `fn` at once on the thread itself."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self.on_thread():
            _run_into(fn, done)
            return done
        with self._lock:
            if self._closed:
                done.set_exception(RuntimeError("the ZMQ receiver hub is closed"))
                return done
            if self._thread is None:
                self._start()
            self._commands.append((fn, done))  # type: ignore[arg-type]
        self._wake()
        with contextlib.suppress(concurrent.futures.TimeoutError):
            done.exception(timeout_s)
        return done

    def close(self, timeout_s: float = 5.0) -> None:
        """Close every receiver's sockets and end the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
            if thread is not None:
                self._commands.append((_stop_marker, concurrent.futures.Future()))
        if thread is None:
            return
        self._wake()
        if not self.on_thread():
            thread.join(timeout_s)

    def _start(self) -> None:
        self._epoll = select.epoll()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)  # a full pipe wakes the thread already
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._thread = threading.Thread(target=self._run, name="kv-sub", daemon=True)
        self._thread.start()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")

    # -- on the thread ---------------------------------------------------------------

    def _add(self, receiver: ZmqReceiver, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        assert self._epoll is not None
        for s, is_monitor in ((sock, False), (monitor, True)):
            fd = _fd(s)
            # level-triggered: libzmq's descriptor stays readable until the socket has
            # processed its commands, which every read of the socket does
            self._epoll.register(fd, select.EPOLLIN)
            self._by_fd[fd] = (receiver, is_monitor)
        self._receivers.add(receiver)
        # what is there already signals nothing: libzmq's descriptor only tells of
        # changes once the socket has been read to the end, so both are read first
        self._fresh.append(receiver)

    def _remove(self, receiver: ZmqReceiver, sock: zmq.Socket, monitor: zmq.Socket) -> None:
        assert self._epoll is not None
        for s in (sock, monitor):
            fd = _fd(s)
            self._by_fd.pop(fd, None)
            with contextlib.suppress(OSError):
                self._epoll.unregister(fd)
        self._receivers.discard(receiver)

    def _run(self) -> None:
        assert self._epoll is not None
        epoll = self._epoll
        # receivers whose socket may still hold frames after their turn: served again
        # before the thread waits (a dict: insertion order is the round robin's)
        backlog: dict[ZmqReceiver, None] = {}
        try:
            while True:
                for fd, _ in epoll.poll(0 if backlog else -1):
                    if fd == self._wake_r:
                        if self._run_commands():
                            return
                        continue
                    entry = self._by_fd.get(fd)
                    if entry is None:
                        continue  # closed by a command of this wake-up
                    receiver, is_monitor = entry
                    if is_monitor:
                        self._serve(receiver._drain_monitor)
                    else:
                        backlog[receiver] = None
                for receiver in self._fresh:
                    self._serve(receiver._drain_monitor)
                    backlog[receiver] = None
                self._fresh.clear()
                for receiver in list(backlog):
                    if not self._serve(receiver._turn):
                        del backlog[receiver]
        except zmq.ContextTerminated:
            log.warning("kv events: the ZMQ context was terminated; receivers stop")
        finally:
            for receiver in list(self._receivers):
                receiver._close()
            with self._lock:
                self._closed = True
                pending = list(self._commands)
                self._commands.clear()
            for _, done in pending:
                if done.set_running_or_notify_cancel():
                    done.set_exception(RuntimeError("the ZMQ receiver hub is closed"))
            epoll.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    @staticmethod
    def _serve(fn: Callable[[], bool | None]) -> bool:
        """One receiver's turn; an error ends its turn, not the hub (which serves every
        source). Returns `fn`'s answer: whether that socket may hold more."""
        try:
            return bool(fn())
        except zmq.ContextTerminated:
            raise
        except zmq.ZMQError as exc:
            log.warning("kv events: a receiver's socket failed: %s", exc)
        except Exception:
            log.exception("kv events: a receiver failed")
        return False

    def _run_commands(self) -> bool:
        """Run what `call` queued; True when one of them is the stop."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass
        while True:
            with self._lock:
                if not self._commands:
                    return False
                fn, done = self._commands.popleft()
            if fn is _stop_marker:
                return True
            if done.set_running_or_notify_cancel():
                _run_into(fn, done)


def _fd(sock: zmq.Socket) -> int:
    """libzmq's descriptor that signals a change of the socket's state (`ZMQ_FD`)."""
    fd = sock.getsockopt(zmq.FD)
    if not isinstance(fd, int):
        raise TypeError(f"ZMQ_FD is {fd!r}, not a file descriptor")
    return fd


def _stop_marker() -> None:
    """The command that ends the hub's thread."""


def _run_into(fn: Callable[[], _T], done: concurrent.futures.Future[_T]) -> None:
    try:
        done.set_result(fn())
    except BaseException as exc:  # the caller's to handle; never kills the hub
        done.set_exception(exc)


class ZmqReceiver:
    """Receives `[topic, seq, payload]` messages of one source and hands them to
    `deliver`, on the hub's thread."""

    # libzmq's default. Frames wait there only while the hub is busy handing over other
    # frames; a deeper buffer would hold, outside any budget, batches the ingestor's
    # full queue then drops anyway.
    RCVHWM = 1000
    DRAIN_MAX = 256  # frames per turn: one queue item, one wake-up of the applier
    START_TIMEOUT_S = 5.0
    STOP_TIMEOUT_S = 2.0

    def __init__(
        self,
        hub: ZmqHub,
        config: ZmqSourceConfig,
        deliver: Deliver,
        on_peer: OnPeer | None = None,
        on_malformed: OnMalformed | None = None,
    ) -> None:
        self.hub = hub
        self.config = config
        self._deliver = deliver
        self._on_peer = on_peer
        self._on_malformed = on_malformed
        self.malformed = 0
        self.bound_endpoint: str | None = None
        self.error: str | None = None
        self._zap: PublisherAllowlist | None = None
        self._sock: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._stopped = False

    @property
    def zap_domain(self) -> str:
        return f"quillcache-kv-{self.config.worker}-{self.config.dp_rank}"

    @property
    def publishers_denied(self) -> int:
        """Connections the allowlist refused (0 without one)."""
        return self._zap.denied.get(self.zap_domain, 0) if self._zap is not None else 0

    @property
    def open(self) -> bool:
        """Its socket is open (on the hub)."""
        return self._sock is not None

    def start(self, timeout_s: float | None = None) -> None:
        """Open the socket on the hub; `OSError` when it cannot bind or connect."""
        done = self.hub.call(self._open, self.START_TIMEOUT_S if timeout_s is None else timeout_s)
        exc = done.exception() if done.done() else None
        if exc is not None:
            raise OSError(f"cannot start the receiver of {self.config.endpoint}: {exc}") from exc
        if self.error:
            raise OSError(self.error)

    def stop(self) -> None:
        """Close its sockets (on the hub); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        done = self.hub.call(self._close, self.STOP_TIMEOUT_S)
        if not done.done():
            log.warning("kv events: receiver of %s did not stop in time", self.config.endpoint)

    # -- on the hub's thread -------------------------------------------------------------

    def _open(self) -> None:
        if self._stopped:
            return  # stopped before the hub got to it
        cfg = self.config
        allowed = None  # a bad entry raises here, before any socket exists
        if cfg.bind and cfg.allowed_publishers is not None:
            allowed = networks(cfg.allowed_publishers)
        sock = self.hub.ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_msg_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        if allowed is not None:
            # before bind: every connection to the socket then goes through the handler
            zap = PublisherAllowlist.for_context(self.hub.ctx)
            zap.allow(self.zap_domain, allowed)
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
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            return
        self._sock, self._monitor = sock, monitor
        self.hub._add(self, sock, monitor)

    def _close(self) -> None:
        sock, monitor = self._sock, self._monitor
        self._stopped = True
        if sock is None or monitor is None:
            return
        self._sock = self._monitor = None
        self.hub._remove(self, sock, monitor)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(0)

    def _drain_monitor(self) -> None:
        monitor = self._monitor
        if monitor is None:
            return
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] & _PEER_EVENTS and self._on_peer is not None:
                try:
                    self._on_peer(self.config.key)
                except Exception:  # the hub serves every source: it must not die of one
                    log.exception("kv events: peer callback of %s failed", self.config.endpoint)

    def _turn(self) -> bool:
        """Up to `DRAIN_MAX` frames into one hand-over; whether the socket may hold more
        (False: libzmq said it has nothing, and will signal the next message)."""
        sock = self._sock
        if sock is None:
            return False
        cfg = self.config
        batch: list[tuple[int, bytes]] = []
        more = True
        for _ in range(self.DRAIN_MAX):
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
            try:
                self._deliver(cfg.key, batch)
            except Exception:  # the hub serves every source: it must not die of one
                log.exception("kv events: hand-over from %s failed", cfg.endpoint)
        return more
