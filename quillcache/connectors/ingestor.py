"""The event ingestor: receivers -> one bounded queue -> one applier thread -> a sink.

Receivers (ZMQ, HTTP) only enqueue. The applier drains the queue, tracks each source's
sequence, replays gaps from the engine's ROUTER socket, and calls `sink.ingest` once per
run of consecutive batches of a source (decode + apply in Rust with the GIL released).
Nothing here runs on the request path, and when the queue is full new batches are
dropped and counted: the gap they leave is replayed later, so a flood costs bounded
memory and some replay work, never an unbounded backlog.

**Order.** A restart can only be seen where the publisher's order is: the receiver
(`WireOrder`) tags each batch with an epoch that turns when a seq is not above the
previous one off the wire. In the applier, a batch of the same epoch that is not above
the last applied one is a duplicate (a replay applied it while it sat in the queue),
never a restart; a newer epoch is a suspected restart, verified on the replay socket
(does the engine still hold our last applied seq, with the same bytes?) or trusted when
there is none. So however far a replay moves a source ahead of its queued batches, the
queue's order can never look like an engine restart.

**Replays fetch what is missing, and no more.** A gap revealed by seq T with L applied
reads [L+1, T-1] and closes the socket there (the rest is queued); batches the full
queue dropped with nothing after them read [L+1, R], R the last seq the receiver saw;
only a quiet source with nothing queued reads to the end marker. A replay is read as it
streams in and applied chunk by chunk (memory bounded however long it is);
`replay_timeout_s` is the wait for the next frame, not a deadline for the transfer. A
replay that stops short (the engine's ROUTER drops replies past its high-water mark)
is asked again from where it stopped. If the replay ends before T-1, the engine has
not published T: the frame is implausible (e.g. a forged seq), dropped and counted
(`implausible_seqs`), and the source does not jump ahead. If the replay starts after
L+1 the engine's buffer no longer holds what was lost: the source is cleared, marked
stale and, once the overload is over, rebuilt in one replay from what the buffer does
hold, a subset of the truth, never a false residency. Exact recovery after a loss
needs the engine's buffer to cover it.

A gap is normally revealed by the next seq. When the last batches a source sent are
lost (its PUB or our SUB over the high-water mark, the full queue, a subscription
still propagating) and the engine then goes quiet, nothing reveals it: so once a
source has been quiet for `quiet_tail_s` after any traffic (a batch, a drop, or a
request the gateway sent it: `expect_events`) and has nothing queued, the applier asks
its replay socket for everything after the last applied seq, once. An empty answer
means up to date.

A new connection with the engine (the socket monitor sees it) counts as traffic too,
and makes that check a restart probe: ask from the last applied seq itself. A healthy
engine still holds it, with the same bytes; a restarted one numbers from 0 again, so
it answers nothing there or other bytes, and the source is cleared and rebuilt from
the new life's seq 0. This catches an engine that restarts and goes quiet before any
of its new batches reach us, and one that restarted while the gateway was down.

Memory: after a large backlog or replay drains, the applier returns freed heap to the
OS (glibc `malloc_trim`), once per such episode: the allocator otherwise keeps the
peak for the life of the process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ctypes.util
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq

from quillcache.connectors.replay import ReplayError, ReplayStream, batch_digest
from quillcache.connectors.sequence import SequenceTracker, Verdict, WireOrder
from quillcache.connectors.sink import IngestSink
from quillcache.connectors.zmq_source import (
    ZmqHub,
    ZmqReceiver,
    ZmqSourceConfig,
    raise_socket_limit,
)
from quillcache.errors import EventDecodeError
from quillcache.index.types import ApplyStats

log = logging.getLogger(__name__)

SourceKey = tuple[int, int]  # (worker, dp_rank)
Frames = list[tuple[int, bytes]]  # (seq, payload), in the publisher's order
_SYNC = -1  # queue marker: replay everything after the last applied seq
_UNSEQUENCED = -2  # HTTP ingest without a seq: applied as it comes
_WAKE = -3  # queue marker: wake the applier for a call waiting in `_calls`
_T = TypeVar("_T")
# Return freed heap to the OS once the applier is idle after holding this much.
_TRIM_AFTER_BYTES = 16 << 20
_REPLAY_CHUNK_BYTES = 1 << 20


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None on another libc (nothing to trim there then)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


_malloc_trim = _libc_malloc_trim()


_REBUILD_AFTER_DROPS_S = 0.25


@dataclass
class IngestReceipt:
    """What became of the batches of one HTTP ingest call: filled on the applier thread,
    which decodes each batch once, as it applies it; `done` resolves when they are through.

    `invalid` holds (batch index, the decoder's message) of the batches that did not
    decode (skipped; the others are applied); batches neither applied nor invalid were
    skipped by sequencing (duplicates of applied seqs, or a source being rebuilt)."""

    batches: int
    first_seq: int | None = None
    applied: int = 0
    invalid: list[tuple[int, str]] = field(default_factory=list)
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


# a queue item: source, wire epoch, its batches, their bytes, the HTTP call's receipt
_Item = tuple[SourceKey, int, Frames, int, IngestReceipt | None]


class _Replayed(enum.Enum):
    REACHED = "reached"  # every batch up to the requested stop is applied
    ENDED = "ended"  # the engine's end marker came first: it holds nothing further
    FAILED = "failed"  # no (more) answer
    LOST = "lost"  # the buffer starts after what was asked: a rebuild is pending


@dataclass
class SourceStatus:
    """What one source did, for metrics, logs and the admin API."""

    worker: int
    dp_rank: int
    endpoint: str = ""
    replay_endpoint: str | None = None
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    wire: WireOrder = field(default_factory=WireOrder)  # the receiver's side
    stale: bool = False
    stale_since: float = 0.0
    received: int = 0
    queued: int = 0  # batches of this source in the queue
    # lost beyond the engine's buffer: rebuild from this seq (what the buffer held at the
    # loss) once none of the source's batches is queued; until then they are skipped
    rebuild_from: int | None = None
    rebuilds: int = 0
    skipped_while_lost: int = 0
    last_drop_s: float = 0.0  # time.monotonic() when the full queue last dropped its batches
    applied_batches: int = 0
    duplicates: int = 0
    dropped: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    stale_marks: int = 0
    restarts: int = 0
    restart_suspects: int = 0  # the wire's order turned back: a restart, verified or not
    implausible_seqs: int = 0  # frames whose seq the engine has not published (dropped)
    malformed: int = 0  # frames the receiver could not read (frame count, seq frame)
    decode_errors: int = 0
    needs_sync: bool = False  # batches were dropped: replay the tail once the queue drains
    # traffic since the last tail check (seen != checked): ask the replay socket once the
    # source is quiet. Counters, not a flag: traffic noted by another thread while the
    # applier checks is never lost to the applier's reset.
    traffic_seen: int = 0
    traffic_checked: int = 0
    last_traffic_s: float = 0.0  # time.monotonic() of the last batch, drop or expectation
    tail_checks: int = 0  # replays asked for because the source went quiet
    tail_replayed_batches: int = 0  # batches that such a check found missing
    peer_connects: int = 0  # connections with the engine set up (first one and reconnects)
    restart_probe: bool = False  # a connection was set up: the next tail check verifies `last`
    # cold start (`caught_up`): a replay read the engine's buffer to its end marker, or a
    # batch from the wire went through the applier (with whatever replay its gap needed)
    replayed_to_end: bool = False
    wire_applied: bool = False
    # set once, when `connected` and (no replay socket, or one of the two above) first
    # held: the gateway's /ready waits for it; it does not go back (a later loss is what
    # `stale` and the replays are for)
    caught_up: bool = False
    apply: ApplyStats = field(default_factory=ApplyStats)

    @property
    def last_seq(self) -> int:
        return self.tracker.last

    @property
    def tail_pending(self) -> bool:
        return self.traffic_seen != self.traffic_checked

    @property
    def connected(self) -> bool:
        """A connection with the engine was set up (the socket monitor saw it) or a batch
        came in: a batch received proves it where the monitor's event was missed."""
        return self.peer_connects > 0 or self.received > 0

    def catching_up(self) -> bool:
        """Whether this source is caught up now, latching `caught_up` the first time:
        connected, and, with a replay socket, what that socket offered is applied (a
        replay reached its end marker, or a batch off the wire went through the applier,
        with the replay of its gap). Without a replay socket nothing can be fetched, so
        being connected is all there is to wait for."""
        if (
            not self.caught_up
            and self.connected
            and (not self.replay_endpoint or self.replayed_to_end or self.wire_applied)
        ):
            self.caught_up = True
            log.info(
                "kv events: worker %d rank %d caught up (last seq %d, %d batches replayed)",
                self.worker,
                self.dp_rank,
                self.tracker.last,
                self.replayed_batches,
            )
        return self.caught_up

    def note_traffic(self) -> None:
        """Any thread. The time first, then the count: a checker that reads the count
        first and the time second never takes new traffic for an old quiet period."""
        self.last_traffic_s = time.monotonic()
        self.traffic_seen += 1

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: v for k, v in vars(self).items() if k not in ("tracker", "apply", "wire")
        }
        out["last_seq"] = self.tracker.last
        out["connected"] = self.connected
        out["epoch"] = self.tracker.epoch
        out["wire_last_seq"] = self.wire.last
        out["wire_epoch"] = self.wire.epoch
        out.update({f"apply_{k}": v for k, v in vars(self.apply).items()})
        return out


@dataclass
class IngestorStats:
    """Totals over every source (a snapshot), and a few counts per source."""

    received: int = 0
    dropped: int = 0
    applied_batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    stale_marks: int = 0
    stale_sources: int = 0
    restarts: int = 0
    restart_suspects: int = 0
    implausible_seqs: int = 0
    malformed: int = 0
    decode_errors: int = 0
    tail_checks: int = 0
    tail_replayed_batches: int = 0
    queue_depth: int = 0
    queue_bytes: int = 0
    sources: int = 0
    sources_caught_up: int = 0  # `SourceStatus.caught_up`: cold start progress
    # one {"worker", "dp_rank", counter: value, ...} per source (JSON-ready)
    publishers_denied: int = 0  # connections refused by a binding source's allowlist
    per_source: list[dict[str, int]] = field(default_factory=list)


_digest = batch_digest


@dataclass(frozen=True)
class SourcePosition:
    """Where one source's applied stream stands, read on the applier thread between two
    applies, so that it agrees with the index at that moment (`EventIngestor.positions`).

    `exact`: the index holds exactly what the engine published up to `last_seq` (seq and
    the digest of that batch known, caught up, not stale, not lost beyond the buffer):
    another replica may take this residency and replay from `last_seq + 1`."""

    worker: int
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    last_seq: int
    digest: int | None
    exact: bool
    why: str  # why not exact ("" when it is)


class EventIngestor:
    """Owns the receivers, the bounded queue and the applier thread for one sink."""

    def __init__(
        self,
        sink: IngestSink,
        *,
        queue_size: int = 10_000,
        drain_batch: int = 512,
        replay_timeout_s: float = 2.0,
        stale_rebuild_s: float = 30.0,
        quiet_tail_s: float = 1.0,
        apply_bytes: int = 32 * 1024,
        queue_bytes: int = 256 << 20,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.apply_bytes = apply_bytes
        # The queue is bounded in batches and in bytes (counted here: one queue item
        # carries every frame a receiver drained at once): a few huge batches must not
        # grow memory either.
        self.queue_size = queue_size
        self.queue_bytes = queue_bytes
        self._queued_batches = 0
        self._queued_bytes = 0
        self._held_peak = 0  # bytes queued or replayed since the last malloc_trim
        # the HTTP call whose batches the applier is applying (`_process_receipted`)
        self._receipt: IngestReceipt | None = None
        self._receipt_base = 0
        self._bytes_lock = threading.Lock()
        self.sink = sink
        self.ctx = ctx or zmq.Context.instance()
        raise_socket_limit(self.ctx)
        self.replay_timeout_s = replay_timeout_s
        self.stale_rebuild_s = stale_rebuild_s
        self.quiet_tail_s = quiet_tail_s  # 0: no tail checks
        self.drain_batch = drain_batch
        self.trims = 0
        # (source, epoch, frames, bytes)
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self.sources: dict[SourceKey, SourceStatus] = {}
        self._ranks: dict[int, tuple[int, ...]] = {}  # worker -> its sources' dp ranks
        self._receivers: dict[SourceKey, ZmqReceiver] = {}
        self._hub = ZmqHub(self.ctx)  # one thread serves every ZMQ receiver
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._next_busy_check = 0.0  # time.monotonic() of the next checks between applies
        # callables to run on the applier thread between two applies (`on_applier`)
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._calls = queue.SimpleQueue()
        # (worker, dp_rank) -> (seq, digest of that batch) a peer snapshot vouched for: the
        # source resumed at that seq keeps the digest, so its restart probe compares bytes
        self.resume_digests: dict[SourceKey, tuple[int, int]] = {}
        self._thread = threading.Thread(target=self._run, name="kv-ingest", daemon=True)
        self._thread.start()

    # -- sources -------------------------------------------------------------------------

    def add_zmq_source(self, config: ZmqSourceConfig, resume_from: int = -1) -> SourceStatus:
        """Subscribe to one engine rank; replay from `resume_from + 1` (a persisted seq)."""
        status = self._status(config.key)
        status.endpoint = config.endpoint
        status.replay_endpoint = config.replay_endpoint
        if resume_from > status.tracker.last:
            status.tracker.last = resume_from
            vouched = self.resume_digests.pop(config.key, None)
            if vouched is not None and vouched[0] == resume_from:
                status.tracker.last_digest = vouched[1]
        receiver = ZmqReceiver(self._hub, config, self._deliver, self._on_peer, self._on_malformed)
        receiver.start()
        with self._lock:
            old = self._receivers.pop(config.key, None)
            self._receivers[config.key] = receiver
        if old is not None:
            old.stop()
        if config.replay_endpoint:
            self._queue.put((config.key, 0, [(_SYNC, b"")], 0, None))  # catch up on what we missed
        return status

    def request_tail_replay(self, worker: int) -> None:
        """Replay what each source of `worker` published after its last applied seq, once
        the queue drains. A lost batch with nothing after it shows no gap: e.g. the batch
        of a parity probe sent before a connecting publisher (real vLLM on a loopback
        endpoint) had received the gateway's subscription."""
        for status in list(self.sources.values()):
            if status.worker == worker and status.replay_endpoint:
                status.needs_sync = True

    def bound_endpoint(self, worker: int, dp_rank: int = 0) -> str | None:
        receiver = self._receivers.get((worker, dp_rank))
        return receiver.bound_endpoint if receiver else None

    def remove_worker(self, worker: int) -> None:
        """Stop every receiver of a worker and forget its sequence state."""
        with self._lock:
            keys = [k for k in self._receivers if k[0] == worker]
            receivers = [self._receivers.pop(k) for k in keys]
        for r in receivers:
            r.stop()
        with self._lock:
            for k in [k for k in self.sources if k[0] == worker]:
                del self.sources[k]
            self._ranks.pop(worker, None)

    def _status(self, key: SourceKey) -> SourceStatus:
        with self._lock:
            status = self.sources.get(key)
            if status is None:
                status = self.sources[key] = SourceStatus(worker=key[0], dp_rank=key[1])
                self._ranks[key[0]] = (*self._ranks.get(key[0], ()), key[1])
            return status

    # -- receiving (any thread) ----------------------------------------------------------

    def expect_events(self, worker: int) -> None:
        """The gateway sent `worker` a request: its events should follow. If none arrive
        (all lost), the quiet-tail check still asks its replay socket."""
        for rank in self._ranks.get(worker, ()):  # once per request: not a fleet scan
            status = self.sources.get((worker, rank))
            if status is not None:
                status.note_traffic()

    def _on_peer(self, key: SourceKey) -> None:
        """A receiver thread saw a connection with the engine set up."""
        status = self.sources.get(key)
        if status is None:
            return
        status.peer_connects += 1
        status.restart_probe = True
        status.note_traffic()
        status.catching_up()

    def _on_malformed(self, key: SourceKey) -> None:
        status = self.sources.get(key)
        if status is not None:
            status.malformed += 1

    def _deliver(self, key: SourceKey, frames: Frames, receipt: IngestReceipt | None = None) -> int:
        """The receiver's hand-over (one source, in the publisher's order); returns how
        many batches the queue took. Only one thread delivers for a source."""
        status = self.sources.get(key) or self._status(key)
        status.received += len(frames)
        status.note_traffic()
        wire = status.wire
        if receipt is not None:  # HTTP: one queue item, so that its outcome is its own
            epoch = wire.epoch
            if frames[0][0] >= 0:  # consecutive seqs: only the first can turn the epoch
                epoch = wire.observe(frames[0][0])
                for seq, _ in frames[1:]:
                    wire.observe(seq)
            return self._enqueue(status, key, epoch, frames, receipt)
        if frames[0][0] < 0:  # unsequenced (HTTP): no order to read
            return self._enqueue(status, key, wire.epoch, frames)
        epoch = wire.epoch
        start = 0
        accepted = 0
        for i, (seq, _) in enumerate(frames):
            if wire.observe(seq) != epoch:  # one queue item holds one epoch
                if i > start:
                    accepted += self._enqueue(status, key, epoch, frames[start:i])
                start, epoch = i, wire.epoch
        part = frames if start == 0 else frames[start:]
        return accepted + self._enqueue(status, key, epoch, part)

    def _enqueue(
        self,
        status: SourceStatus,
        key: SourceKey,
        epoch: int,
        frames: Frames,
        receipt: IngestReceipt | None = None,
    ) -> int:
        n = len(frames)
        take = size = 0
        with self._bytes_lock:
            room = self.queue_size - self._queued_batches
            budget = self.queue_bytes - self._queued_bytes
            for _, payload in frames:
                if take >= room or size + len(payload) > budget:
                    break
                size += len(payload)
                take += 1
            self._queued_batches += take
            self._queued_bytes += size
            status.queued += take
            self._held_peak = max(self._held_peak, self._queued_bytes)
        if take:
            self._queue.put((key, epoch, frames if take == n else frames[:take], size, receipt))
        if take < n:
            status.dropped += n - take  # the gap they leave is replayed (next batch, or idle)
            status.needs_sync = True
            status.last_drop_s = time.monotonic()
        return take

    def submit(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        seq: int | None = None,
        receipt: IngestReceipt | None = None,
    ) -> int:
        """HTTP ingest: enqueue batches (numbered from `seq` if given); returns how many fit.
        With a `receipt`, all or none are queued, and the receipt tells what became of them."""
        if not payloads:
            if receipt is not None:
                receipt.done.set_result(None)
            return 0
        key = (worker, dp_rank)
        self._status(key)
        if seq is None:
            frames = [(_UNSEQUENCED, p) for p in payloads]
        else:
            frames = [(seq + i, p) for i, p in enumerate(payloads)]
        if receipt is not None:
            receipt.first_seq = seq
            if not self._fits(frames):
                return 0
        return self._deliver(key, frames, receipt)

    def _fits(self, frames: Frames) -> bool:
        with self._bytes_lock:
            room = self.queue_size - self._queued_batches
            budget = self.queue_bytes - self._queued_bytes
        return len(frames) <= room and sum(len(p) for _, p in frames) <= budget

    # -- applying (the applier thread) ---------------------------------------------------

    # how often the applier looks at its sources when the queue is empty: every 50 ms
    # while one has something pending, else 4 times a second (an idle fleet of a
    # thousand sources is otherwise scanned 20 times a second for nothing; new batches
    # wake the applier at once either way)
    TICK_S = 0.05
    IDLE_TICK_S = 0.25

    def on_applier(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Run `fn` on the applier thread between two applies: every source's sequence
        state then agrees with the index (a run of batches is applied whole before the
        applier looks at its calls). Its result or exception comes back in the future.
        `fn` holds up the applier while it runs (the queue buffers meanwhile)."""
        done: concurrent.futures.Future[_T] = concurrent.futures.Future()
        if self._stop.is_set():
            done.set_exception(RuntimeError("the event ingestor is closed"))
            return done
        self._calls.put((fn, done))
        self._queue.put(((-1, -1), 0, [(_WAKE, b"")], 0, None))
        return done

    def positions(self) -> list[SourcePosition]:
        """Every source's position (call it on the applier thread: `on_applier`)."""
        out = []
        for s in list(self.sources.values()):
            t = s.tracker
            why = ""
            if not s.caught_up:
                why = "not caught up"
            elif s.stale or s.rebuild_from is not None:
                why = "stale (events lost beyond the engine's buffer)"
            elif t.last < 0:
                why = "nothing applied yet"
            elif t.last_digest is None:
                why = "the last applied batch's bytes are not known"
            elif not s.replay_endpoint:
                why = "no replay socket"
            out.append(
                SourcePosition(
                    worker=s.worker,
                    dp_rank=s.dp_rank,
                    endpoint=s.endpoint,
                    replay_endpoint=s.replay_endpoint,
                    last_seq=t.last,
                    digest=t.last_digest,
                    exact=not why,
                    why=why,
                )
            )
        return out

    def _run_calls(self) -> None:
        while True:
            try:
                fn, done = self._calls.get_nowait()
            except queue.Empty:
                return
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller, never kills the applier
                done.set_exception(exc)

    def _run(self) -> None:
        tick = self.TICK_S
        while not self._stop.is_set():
            self._run_calls()
            try:
                first = self._queue.get(timeout=tick)
            except queue.Empty:
                # one pass over the sources, not four: the checks below look only at
                # sources with something pending (an idle fleet has none), since this
                # runs 20 times a second and a fleet may have a thousand sources
                pending = self._pending_sources()
                tick = self.TICK_S if pending else self.IDLE_TICK_S
                busy = self._rebuild_lost_sources(pending)
                busy = self._sync_dropped_tails(pending) or busy
                busy = self._check_quiet_tails(pending) or busy
                if not busy:
                    self._idle.set()
                    self._trim_if_held()
                self._expire_stale(pending)
                continue
            self._idle.clear()
            tick = self.TICK_S
            items = [first]
            count = len(first[2])
            while count < self.drain_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
                count += len(item[2])
            items = [i for i in items if i[2][0][0] != _WAKE]
            if not items:
                continue  # only calls to run: the loop's top runs them
            with self._bytes_lock:
                for key, _, frames, size, _ in items:
                    if frames[0][0] == _SYNC:
                        continue
                    self._queued_batches -= len(frames)
                    self._queued_bytes -= size
                    status = self.sources.get(key)
                    if status is not None:
                        status.queued -= len(frames)
            run_key = items[0][0]
            run: list[tuple[int, Frames]] = []
            for key, epoch, frames, _, receipt in items:
                if receipt is not None:
                    self._process(run_key, run)
                    run_key, run = key, []
                    self._process_receipted(key, epoch, frames, receipt)
                    continue
                if key != run_key:
                    self._process(run_key, run)
                    run_key, run = key, []
                run.append((epoch, frames))
            self._process(run_key, run)
            # a source these batches left lost is rebuilt at once, as when idle
            lost = [
                s
                for key in {item[0] for item in items}
                if (s := self.sources.get(key)) is not None and s.rebuild_from is not None
            ]
            if lost:
                self._rebuild_lost_sources(lost)
            # a quiet source next to a busy one: the same checks as when idle, at the
            # same pace, not after every hand-over (each is a pass over the fleet, and
            # under load a hand-over is mostly one batch)
            now = time.monotonic()
            if now >= self._next_busy_check:
                self._next_busy_check = now + self.TICK_S
                pending = self._pending_sources()
                self._rebuild_lost_sources(pending)
                self._check_quiet_tails(pending)
                self._expire_stale(pending)

    def _pending_sources(self) -> list[SourceStatus]:
        """The sources that one of the idle checks may act on: lost (waiting for a
        rebuild), with dropped tails, stale, or with traffic not checked yet."""
        return [
            s
            for s in list(self.sources.values())
            if s.rebuild_from is not None
            or s.needs_sync
            or s.stale
            or s.traffic_seen != s.traffic_checked
        ]

    def _trim_if_held(self) -> None:
        if self._held_peak < _TRIM_AFTER_BYTES or _malloc_trim is None:
            return
        self._held_peak = 0
        self.trims += 1
        _malloc_trim(0)

    def _sync_dropped_tails(self, sources: list[SourceStatus] | None = None) -> bool:
        """Replay [last applied + 1, last seq received] of every source that lost batches
        to a full queue: the last batches of a burst may have been dropped with nothing
        after them to reveal the gap. Returns whether there was anything to do."""
        todo = [
            s
            for s in (list(self.sources.values()) if sources is None else sources)
            # a source lost beyond its buffer waits for its rebuild, which covers this
            if s.needs_sync and not s.queued and s.rebuild_from is None
        ]
        for status in todo:
            status.needs_sync = False
            if not status.replay_endpoint:
                continue
            try:
                if status.wire.epoch > status.tracker.epoch:
                    self._check_life(status, status.wire.epoch, wire_turned=True)
                if status.wire.last > status.tracker.last:
                    self._replay_range(status, status.tracker.last + 1, status.wire.last)
            except Exception:
                log.exception("kv events: tail replay of worker %d failed", status.worker)
        return bool(todo)

    def _check_quiet_tails(self, sources: list[SourceStatus] | None = None) -> bool:
        """Replay after the last applied seq of every source quiet for `quiet_tail_s` since
        its last traffic, with nothing queued (what is queued is not missing). At most one
        check per source per quiet period: the next needs new traffic (a replayed batch is
        not traffic), so an idle gateway never polls. Returns whether there was anything
        to do."""
        if self.quiet_tail_s <= 0:
            return False
        now = time.monotonic()
        due: list[tuple[SourceStatus, int]] = []
        for s in list(self.sources.values()) if sources is None else sources:
            seen = s.traffic_seen  # read before last_traffic_s: see note_traffic
            if (
                seen != s.traffic_checked
                and s.replay_endpoint
                and not s.queued
                and s.rebuild_from is None  # its rebuild reads to the end marker anyway
                and now - s.last_traffic_s >= self.quiet_tail_s
            ):
                due.append((s, seen))
        for status, seen in due:
            status.traffic_checked = seen  # traffic noted since then re-arms it
            if self.sources.get((status.worker, status.dp_rank)) is not status:
                continue  # removed meanwhile
            before = status.replayed_batches
            try:
                epoch = status.wire.epoch
                if status.restart_probe or epoch > status.tracker.epoch:
                    status.restart_probe = False
                    self._check_life(status, epoch, wire_turned=epoch > status.tracker.epoch)
                self._replay_range(status, status.tracker.last + 1, None)
            except Exception:
                log.exception("kv events: tail check of worker %d failed", status.worker)
            status.tail_checks += 1  # counted once done: observers see its effects
            found = status.replayed_batches - before
            if found:
                status.tail_replayed_batches += found
                log.info(
                    "kv events: worker %d rank %d was quiet with %d batches missing; replayed",
                    status.worker,
                    status.dp_rank,
                    found,
                )
        return bool(due)

    def _process_receipted(
        self, key: SourceKey, epoch: int, frames: Frames, receipt: IngestReceipt
    ) -> None:
        """One HTTP call's batches, alone, so that what was applied is theirs."""
        status = self._status(key)
        before = self._receipt_base = status.applied_batches
        self._receipt = receipt
        try:
            self._process(key, [(epoch, frames)])
        finally:
            self._receipt = None
            receipt.applied = status.applied_batches - before
            receipt.done.set_result(None)

    def _process(self, key: SourceKey, parts: list[tuple[int, Frames]]) -> None:
        if not parts:
            return
        try:
            self._process_unsafe(key, parts)
        except KeyError as exc:  # e.g. the worker was removed while its batches were queued
            log.info("kv events: batches of source %s dropped: %s", key, exc)
        except Exception:  # the applier must survive anything a sink or a socket does
            log.exception("kv events: failed to process batches of source %s", key)

    def _process_unsafe(self, key: SourceKey, parts: list[tuple[int, Frames]]) -> None:
        status = self._status(key)
        tracker = status.tracker
        pending: Frames = []  # (seq or -1, payload), consecutive, not applied yet
        wire = False  # a sequenced batch went through (`SourceStatus.wire_applied`)
        for epoch, frames in parts:
            head = frames[0][0]
            if status.rebuild_from is not None and head >= 0:
                # its rebuild replays the engine's buffer anyway, these batches included
                status.skipped_while_lost += len(frames)
                continue
            if head == _UNSEQUENCED:
                pending.extend((-1, p) for _, p in frames)
                continue
            if head == _SYNC:
                self._flush(status, pending)
                pending = []
                if status.rebuild_from is None:  # else its rebuild replays this and more
                    self._replay_range(status, tracker.last + 1, None)
                continue
            if tracker.classify(head, epoch) is Verdict.RESTART:
                self._flush(status, pending)
                pending = []
                self._check_life(status, epoch, wire_turned=True)
            for i, (seq, payload) in enumerate(frames):
                if status.rebuild_from is not None:  # lost at a gap in this part
                    status.skipped_while_lost += len(frames) - i
                    break
                last = tracker.last
                through = True  # applied, or already applied by a replay
                if seq == last + 1:
                    pending.append((seq, payload))
                    tracker.last = seq
                elif seq <= last:
                    status.duplicates += 1  # a replay applied it while it was queued
                else:
                    self._flush(status, pending)
                    pending = []
                    through = self._fill_gap(status, seq)
                    if through:
                        pending.append((seq, payload))
                        tracker.last = seq
                wire = wire or through
        self._flush(status, pending)
        if wire and not status.wire_applied:
            status.wire_applied = True
            status.catching_up()

    def _flush(self, status: SourceStatus, pending: Frames) -> None:
        """Apply consecutive pending batches; keep the digest of the last (restart probes)."""
        if not pending:
            return
        self._apply(status, pending)
        seq, payload = pending[-1]
        if seq >= 0 and seq == status.tracker.last:
            status.tracker.last_digest = _digest(payload)

    def _fill_gap(self, status: SourceStatus, seq: int) -> bool:
        """Replay what comes before `seq`; returns whether `seq` is to be applied."""
        tracker = status.tracker
        status.gaps += 1
        if not status.replay_endpoint:
            self._mark_stale(status, f"gap before seq {seq} and no replay socket")
            return True  # rebuilt from here on
        outcome = self._replay_range(status, tracker.last + 1, seq - 1)
        if outcome is _Replayed.REACHED:
            return True
        if outcome is _Replayed.LOST:
            return False  # the rebuild will replay it
        if outcome is _Replayed.ENDED:
            # The engine's buffer ends before `seq`: it has not published it (a forged or
            # corrupt seq). Jumping there would make every real batch after it a duplicate.
            status.implausible_seqs += 1
            log.warning(
                "kv events: worker %d rank %d: seq %d is beyond everything the engine has "
                "published (its replay ends at %d); frame dropped",
                status.worker,
                status.dp_rank,
                seq,
                tracker.last,
            )
            return False
        status.replay_failures += 1
        self._mark_stale(status, f"replay before seq {seq} failed")
        return True  # rebuilt from here on

    def _check_life(self, status: SourceStatus, epoch: int, *, wire_turned: bool) -> None:
        """Is the engine still the life we applied? It is if its replay socket holds our
        last applied seq with the same bytes (no digest after a gateway restart: holding
        it at all). If not, clear the source and number from scratch. `wire_turned`: the
        receiver saw the seq go back, so an engine that cannot be asked is trusted to
        have restarted; after a mere reconnect it is left as it is."""
        tracker = status.tracker
        if wire_turned:
            status.restart_suspects += 1
        if tracker.last < 0:
            tracker.same_life(epoch)
            return
        held: bool | None = None
        if status.replay_endpoint:
            held = self._holds_last(status)
        if held or (held is None and not wire_turned):
            tracker.same_life(epoch)
            return
        status.restarts += 1
        log.warning(
            "kv events: worker %d rank %d restarted (%s seq %d as applied); clearing it",
            status.worker,
            status.dp_rank,
            "its replay socket no longer holds" if held is False else "seq back on the wire after",
            tracker.last,
        )
        self.sink.clear_source(status.worker, status.dp_rank)
        tracker.restarted(epoch)

    def _holds_last(self, status: SourceStatus) -> bool | None:
        """Whether the engine's replay socket holds our last applied batch; None: no answer."""
        tracker = status.tracker
        last, digest = tracker.last, tracker.last_digest
        assert status.replay_endpoint is not None
        status.replays += 1
        stream = ReplayStream(
            self.ctx, status.replay_endpoint, last, self.replay_timeout_s, stop_seq=last
        )
        try:
            with contextlib.closing(stream.chunks()) as chunks:
                for chunk in chunks:
                    seq, payload = chunk[0]
                    return seq == last and (digest is None or _digest(payload) == digest)
        except ReplayError as exc:
            status.replay_failures += 1
            log.warning("kv events: restart check of worker %d failed: %s", status.worker, exc)
            return None
        return False  # the end marker straight away: nothing from `last` on

    def _replay_range(
        self, status: SourceStatus, start: int, stop: int | None, *, rebuilding: bool = False
    ) -> _Replayed:
        """Replay and apply [start, stop] (to the end marker when `stop` is None), chunk by
        chunk as it streams in. A stream with a hole (replies dropped by the engine's
        ROUTER past its high-water mark) is asked again from the hole. A replay starting
        after `start` means those batches are gone: the source is cleared, marked stale,
        and rebuilt from what the buffer holds once none of its batches is queued (one
        rebuild per overload, not one per gap: `_rebuild_lost_sources`)."""
        if not status.replay_endpoint:
            return _Replayed.FAILED
        pos = start
        while True:
            status.replays += 1
            stream = ReplayStream(
                self.ctx,
                status.replay_endpoint,
                pos,
                self.replay_timeout_s,
                stop_seq=stop,
                chunk_bytes=min(_REPLAY_CHUNK_BYTES, self.apply_bytes * 32),
            )
            progressed = hole = False
            fresh = True  # nothing read on this request yet: no reply can have been dropped
            try:
                with contextlib.closing(stream.chunks()) as chunks:
                    for chunk in chunks:
                        batch: Frames = []
                        for seq, payload in chunk:
                            if seq < pos:
                                continue
                            if seq > pos:
                                if not fresh:
                                    hole = True
                                    break
                                if not rebuilding:
                                    self._lost(status, pos, seq)
                                    return _Replayed.LOST
                                pos = seq  # a rebuild takes the buffer from where it starts
                            fresh = False
                            if stop is not None and seq > stop:
                                break  # after a loss: nothing of the range is left
                            batch.append((seq, payload))
                            pos = seq + 1
                            if stop is not None and seq >= stop:
                                break
                        if batch:
                            self._apply_replayed(status, batch)
                            progressed = True
                        if hole or (stop is not None and pos > stop):
                            break
            except ReplayError as exc:
                status.replay_failures += 1
                log.warning("kv events: replay of worker %d failed: %s", status.worker, exc)
                return _Replayed.FAILED
            if stop is not None and pos > stop:
                return _Replayed.REACHED
            if hole or (progressed and not stream.complete):
                continue  # ask again from where it stopped
            if stream.complete:
                status.replayed_to_end = True
                status.catching_up()
                return _Replayed.ENDED
            status.replay_failures += 1
            log.warning(
                "kv events: replay of worker %d from seq %d stopped without its end",
                status.worker,
                pos,
            )
            return _Replayed.FAILED

    def _apply_replayed(self, status: SourceStatus, batch: Frames) -> None:
        self._apply(status, batch)
        seq, payload = batch[-1]
        status.tracker.applied(seq, _digest(payload))
        status.replayed_batches += len(batch)
        self._held_peak += sum(len(p) for _, p in batch)

    def _lost(self, status: SourceStatus, wanted: int, first: int) -> None:
        status.replay_failures += 1
        why = f"replay from seq {wanted} starts at {first}: the engine's buffer is too short"
        self._mark_stale(status, why)
        status.tracker.restarted(status.tracker.epoch)
        status.rebuild_from = first

    def _rebuild_lost_sources(self, sources: list[SourceStatus] | None = None) -> bool:
        """Rebuild every source lost beyond its engine's buffer whose queued batches are
        all skipped by now: replay the buffer from where it started at the loss (or from
        where it starts now, if it moved on) to its end. Returns whether any was due."""
        now = time.monotonic()
        due = [
            s
            for s in (list(self.sources.values()) if sources is None else sources)
            if s.rebuild_from is not None
            and not s.queued
            # still overflowing the queue: a rebuild now would be lost again at once
            and now - s.last_drop_s >= _REBUILD_AFTER_DROPS_S
        ]
        for status in due:
            start = status.rebuild_from
            assert start is not None
            status.rebuild_from = None
            status.rebuilds += 1
            try:
                self._replay_range(status, start, None, rebuilding=True)
            except Exception:
                log.exception("kv events: rebuild of worker %d failed", status.worker)
        return bool(due)

    def _mark_stale(self, status: SourceStatus, why: str) -> None:
        log.warning(
            "kv events: worker %d rank %d is stale (%s); its residency is unknown until rebuilt",
            status.worker,
            status.dp_rank,
            why,
        )
        status.stale_marks += 1
        self.sink.clear_source(status.worker, status.dp_rank)
        status.stale = True
        status.stale_since = time.monotonic()
        self.sink.set_stale(status.worker, status.dp_rank, True)

    def _expire_stale(self, sources: list[SourceStatus] | None = None) -> None:
        now = time.monotonic()
        for status in list(self.sources.values()) if sources is None else sources:
            if status.stale and now - status.stale_since >= self.stale_rebuild_s:
                status.stale = False
                self.sink.set_stale(status.worker, status.dp_rank, False)
                log.info("kv events: worker %d rank %d rebuilt", status.worker, status.dp_rank)

    def _apply(self, status: SourceStatus, items: Frames) -> None:
        """Apply (seq, payload) items in slices of at most `apply_bytes`: the native index
        holds its write lock for a whole call, and a request's match must never wait
        behind a long one."""
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and (
                end == start or size + len(items[end][1]) <= self.apply_bytes
            ):
                size += len(items[end][1])
                end += 1
            self._apply_slice(status, items[start:end])
            start = end

    def _apply_slice(self, status: SourceStatus, items: Frames) -> None:
        while items:
            payloads = [p for _, p in items]
            seqs = [q for q, _ in items]
            try:
                # a persistent index records them: after a restart, replay from there
                known = seqs if seqs[0] >= 0 else None  # HTTP ingest without seqs: none
                stats = self.sink.ingest(status.worker, payloads, status.dp_rank, known)
            except EventDecodeError as exc:
                # the sink's contract (IngestSink.ingest): which batch failed, and the
                # stats of the ones applied before it
                bad: int = exc.payload_index
                status.decode_errors += 1
                if self._receipt is not None:
                    self._receipt_invalid(status, bad, items[bad][0], str(exc))
                log.warning(
                    "kv events: worker %d rank %d: undecodable batch skipped: %s",
                    status.worker,
                    status.dp_rank,
                    exc,
                )
                status.applied_batches += bad
                status.apply += exc.stats
                items = items[bad + 1 :]
                continue
            status.applied_batches += len(payloads)
            status.apply += stats
            return

    def _receipt_invalid(self, status: SourceStatus, bad: int, seq: int, message: str) -> None:
        """Batch `bad` of the slice being applied (seq `seq`) did not decode."""
        receipt = self._receipt
        assert receipt is not None
        if receipt.first_seq is not None:
            index = seq - receipt.first_seq
        else:  # unsequenced batches reach the decoder in order, none skipped
            applied = status.applied_batches + bad - self._receipt_base
            index = applied + len(receipt.invalid)
        receipt.invalid.append((index, message))

    # -- lifecycle and observation -------------------------------------------------------

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until the queue is drained (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05) and self._queue.empty():
                return True
        return False

    def stats(self) -> IngestorStats:
        out = IngestorStats(queue_depth=self._queued_batches, queue_bytes=self._queued_bytes)
        with self._lock:
            denied = {k: r.publishers_denied for k, r in self._receivers.items()}
        out.publishers_denied = sum(denied.values())
        for s in list(self.sources.values()):
            out.received += s.received
            out.dropped += s.dropped
            out.applied_batches += s.applied_batches
            out.blocks_stored += s.apply.blocks_stored
            out.blocks_removed += s.apply.blocks_removed
            out.gaps += s.gaps
            out.replays += s.replays
            out.replayed_batches += s.replayed_batches
            out.replay_failures += s.replay_failures
            out.stale_marks += s.stale_marks
            out.stale_sources += s.stale
            out.restarts += s.restarts
            out.restart_suspects += s.restart_suspects
            out.implausible_seqs += s.implausible_seqs
            out.malformed += s.malformed
            out.decode_errors += s.decode_errors
            out.tail_checks += s.tail_checks
            out.tail_replayed_batches += s.tail_replayed_batches
            out.sources += 1
            out.sources_caught_up += s.caught_up
            out.per_source.append(
                {
                    "worker": s.worker,
                    "dp_rank": s.dp_rank,
                    "malformed": s.malformed,
                    "decode_errors": s.decode_errors,
                    "implausible_seqs": s.implausible_seqs,
                    "restarts": s.restarts,
                    "dropped": s.dropped,
                    "publishers_denied": denied.get((s.worker, s.dp_rank), 0),
                }
            )
        return out

    def close(self) -> None:
        with self._lock:
            self._receivers.clear()
        self._hub.close()  # every receiver's sockets, on the hub's thread, at once
        self._stop.set()
        self._thread.join(timeout=2.0)
        while True:  # calls the applier will not run now
            try:
                _, done = self._calls.get_nowait()
            except queue.Empty:
                break
            if done.set_running_or_notify_cancel():
                done.set_exception(RuntimeError("the event ingestor is closed"))
        # an HTTP call still waiting learns that none of its batches will be applied
        while True:
            try:
                receipt = self._queue.get_nowait()[4]
            except queue.Empty:
                break
            if receipt is not None and not receipt.done.done():
                receipt.done.set_result(None)
