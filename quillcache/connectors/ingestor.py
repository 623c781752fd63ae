"""The event ingestor: receivers -> one bounded queue -> one applier thread -> a sink.

Receivers (ZMQ, HTTP) only enqueue. The applier drains the queue in batches, tracks
each source's sequence, replays gaps from the engine's ROUTER socket, and calls
`sink.ingest` once per run of consecutive batches of a source (decode + apply in Rust
with the GIL released). Nothing here runs on the request path, and when the queue is
full new batches are dropped and counted: the gap they leave is replayed later, so a
flood costs bounded memory and some replay work, never an unbounded backlog.

A gap is normally revealed by the next seq. When the last batches a source sent are
lost (its PUB or our SUB over the high-water mark, the full queue, a subscription
still propagating) and the engine then goes quiet, nothing reveals it: so once a
source has been quiet for `quiet_tail_s` after any traffic (a batch, a drop, or a
request the gateway sent it: `expect_events`), the applier asks its replay socket
for everything after the last applied seq, once. An empty answer means up to date.

A new connection with the engine (the socket monitor sees it) counts as traffic too,
and makes that check a restart probe: ask from the last applied seq itself. A healthy
engine still holds it, with the same bytes; a restarted one numbers from 0 again, so
it answers nothing there or other bytes, and the source is cleared and rebuilt from
the new life's seq 0. This catches an engine that restarts and goes quiet before any
of its new batches reach us, and one that restarted while the gateway was down.
"""

from __future__ import annotations

import itertools
import logging
import queue
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import xxhash
import zmq

from quillcache.connectors.replay import ReplayError, fetch_replay
from quillcache.connectors.sequence import SequenceTracker, Verdict
from quillcache.connectors.sink import IngestSink
from quillcache.connectors.zmq_source import ZmqReceiver, ZmqSourceConfig
from quillcache.errors import EventDecodeError
from quillcache.index.types import ApplyStats

log = logging.getLogger(__name__)

SourceKey = tuple[int, int]  # (worker, dp_rank)
_SYNC = -1  # queue marker: replay everything after the last applied seq
_UNSEQUENCED = -2  # HTTP ingest without a seq: applied as it comes


@dataclass
class SourceStatus:
    """What one source did, for metrics, logs and the admin API."""

    worker: int
    dp_rank: int
    endpoint: str = ""
    replay_endpoint: str | None = None
    tracker: SequenceTracker = field(default_factory=SequenceTracker)
    stale: bool = False
    stale_since: float = 0.0
    received: int = 0
    applied_batches: int = 0
    duplicates: int = 0
    dropped: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    stale_marks: int = 0
    restarts: int = 0
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
    apply: ApplyStats = field(default_factory=ApplyStats)

    @property
    def last_seq(self) -> int:
        return self.tracker.last

    @property
    def tail_pending(self) -> bool:
        return self.traffic_seen != self.traffic_checked

    def note_traffic(self) -> None:
        """Any thread. The time first, then the count: a checker that reads the count
        first and the time second never takes new traffic for an old quiet period."""
        self.last_traffic_s = time.monotonic()
        self.traffic_seen += 1

    def as_dict(self) -> dict[str, object]:
        out: dict[str, object] = {
            k: v for k, v in vars(self).items() if k not in ("tracker", "apply")
        }
        out["last_seq"] = self.tracker.last
        out.update({f"apply_{k}": v for k, v in vars(self.apply).items()})
        return out


@dataclass
class IngestorStats:
    """Totals over every source (a snapshot)."""

    received: int = 0
    dropped: int = 0
    applied_batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    stale_marks: int = 0
    stale_sources: int = 0
    restarts: int = 0
    decode_errors: int = 0
    tail_checks: int = 0
    tail_replayed_batches: int = 0
    queue_depth: int = 0
    queue_bytes: int = 0


def _failed_batch_index(exc: EventDecodeError, n: int) -> int | None:
    """Which batch of the call failed: an attribute if the binding gives one, else the message."""
    for attr in ("payload_index", "batch_index", "index"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and 0 <= value < n:
            return value
    found = re.search(r"batch(?:es)?\D{0,12}(\d+)", str(exc))
    if found and int(found.group(1)) < n:
        return int(found.group(1))
    return 0 if n == 1 else None


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
        # The queue is bounded in batches and in bytes: a few huge batches must not
        # grow memory either.
        self.queue_bytes = queue_bytes
        self._queued_bytes = 0
        self._bytes_lock = threading.Lock()
        self._sink_takes_seqs = bool(getattr(sink, "accepts_seqs", False))
        self.sink = sink
        self.ctx = ctx or zmq.Context.instance()
        self.replay_timeout_s = replay_timeout_s
        self.stale_rebuild_s = stale_rebuild_s
        self.quiet_tail_s = quiet_tail_s  # 0: no tail checks
        self.drain_batch = drain_batch
        self._queue: queue.Queue[tuple[SourceKey, int, bytes]] = queue.Queue(queue_size)
        self.sources: dict[SourceKey, SourceStatus] = {}
        self._receivers: dict[SourceKey, ZmqReceiver] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._idle = threading.Event()
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
        receiver = ZmqReceiver(self.ctx, config, self._deliver, self._on_peer)
        receiver.start()
        with self._lock:
            old = self._receivers.pop(config.key, None)
            self._receivers[config.key] = receiver
        if old is not None:
            old.stop()
        if config.replay_endpoint:
            self._queue.put((config.key, _SYNC, b""))  # catch up on what we missed
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

    def _status(self, key: SourceKey) -> SourceStatus:
        with self._lock:
            status = self.sources.get(key)
            if status is None:
                status = self.sources[key] = SourceStatus(worker=key[0], dp_rank=key[1])
            return status

    # -- receiving (any thread) ----------------------------------------------------------

    def expect_events(self, worker: int) -> None:
        """The gateway sent `worker` a request: its events should follow. If none arrive
        (all lost), the quiet-tail check still asks its replay socket."""
        for status in list(self.sources.values()):
            if status.worker == worker:
                status.note_traffic()

    def _on_peer(self, key: SourceKey) -> None:
        """A receiver thread saw a connection with the engine set up."""
        status = self.sources.get(key)
        if status is None:
            return
        status.peer_connects += 1
        status.restart_probe = True
        status.note_traffic()

    def _deliver(self, key: SourceKey, seq: int, payload: bytes) -> None:
        status = self.sources.get(key) or self._status(key)
        status.received += 1
        status.note_traffic()
        with self._bytes_lock:
            room = self._queued_bytes + len(payload) <= self.queue_bytes
            if room:
                self._queued_bytes += len(payload)
        try:
            if not room:
                raise queue.Full
            self._queue.put_nowait((key, seq, payload))
        except queue.Full:
            if room:
                with self._bytes_lock:
                    self._queued_bytes -= len(payload)
            status.dropped += 1  # the gap it leaves is replayed (next batch, or when idle)
            status.needs_sync = True

    def submit(
        self, worker: int, payloads: Sequence[bytes], dp_rank: int = 0, seq: int | None = None
    ) -> int:
        """HTTP ingest: enqueue batches (numbered from `seq` if given); returns how many fit."""
        key = (worker, dp_rank)
        accepted = 0
        for i, payload in enumerate(payloads):
            before = self._status(key).dropped
            self._deliver(key, _UNSEQUENCED if seq is None else seq + i, payload)
            accepted += self._status(key).dropped == before
        return accepted

    # -- applying (the applier thread) ---------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.05)
            except queue.Empty:
                busy = self._sync_dropped_tails()
                busy = self._check_quiet_tails() or busy
                if not busy:
                    self._idle.set()
                self._expire_stale()
                continue
            self._idle.clear()
            items = [first]
            while len(items) < self.drain_batch:
                try:
                    items.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            with self._bytes_lock:
                self._queued_bytes -= sum(len(p) for _, _, p in items)
            run_key, run = items[0][0], []
            for key, seq, payload in items:
                if key != run_key:
                    self._process(run_key, run)
                    run_key, run = key, []
                run.append((seq, payload))
            self._process(run_key, run)
            self._check_quiet_tails()  # a quiet source next to a busy one
            self._expire_stale()

    def _sync_dropped_tails(self) -> bool:
        """Replay after the last applied seq of every source that lost batches to a full
        queue: the last batches of a burst may have been dropped with nothing after them
        to reveal the gap. Returns whether there was anything to do."""
        todo = [s for s in list(self.sources.values()) if s.needs_sync]
        for status in todo:
            status.needs_sync = False
            try:
                self._replay(status, status.tracker.last + 1, trigger=None)
            except Exception:
                log.exception("kv events: tail replay of worker %d failed", status.worker)
        return bool(todo)

    def _check_quiet_tails(self) -> bool:
        """Replay after the last applied seq of every source quiet for `quiet_tail_s` since
        its last traffic. At most one check per source per quiet period: the next needs
        new traffic (a replayed batch is not traffic), so an idle gateway never polls.
        Returns whether there was anything to do."""
        if self.quiet_tail_s <= 0:
            return False
        now = time.monotonic()
        due: list[tuple[SourceStatus, int]] = []
        for s in list(self.sources.values()):
            seen = s.traffic_seen  # read before last_traffic_s: see note_traffic
            if (
                seen != s.traffic_checked
                and s.replay_endpoint
                and now - s.last_traffic_s >= self.quiet_tail_s
            ):
                due.append((s, seen))
        for status, seen in due:
            status.traffic_checked = seen  # traffic noted since then re-arms it
            if self.sources.get((status.worker, status.dp_rank)) is not status:
                continue  # removed meanwhile
            before = status.replayed_batches
            try:
                if status.restart_probe and status.tracker.last >= 0:
                    self._probe_restart(status)
                else:
                    status.restart_probe = False
                    self._replay(status, status.tracker.last + 1, trigger=None)
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

    def _process(self, key: SourceKey, items: list[tuple[int, bytes]]) -> None:
        try:
            self._process_unsafe(key, items)
        except KeyError as exc:  # e.g. the worker was removed while its batches were queued
            log.info("kv events: %d batches of source %s dropped: %s", len(items), key, exc)
        except Exception:  # the applier must survive anything a sink or a socket does
            log.exception("kv events: failed to process %d batches of source %s", len(items), key)

    def _process_unsafe(self, key: SourceKey, items: list[tuple[int, bytes]]) -> None:
        status = self._status(key)
        tracker = status.tracker
        pending: list[tuple[int, bytes]] = []  # (seq or -1, payload)
        for seq, payload in items:
            if seq == _UNSEQUENCED:
                pending.append((-1, payload))
                continue
            if seq == _SYNC:
                self._apply(status, pending)
                pending = []
                self._replay(status, tracker.last + 1, trigger=None)
                continue
            digest = xxhash.xxh3_64_intdigest(payload)
            verdict = tracker.classify(seq, digest)
            if verdict is Verdict.RESTART:
                self._apply(status, pending)
                pending = []
                status.restarts += 1
                log.warning(
                    "kv events: worker %d rank %d restarted (seq %d after %d); clearing it",
                    status.worker,
                    status.dp_rank,
                    seq,
                    tracker.last,
                )
                self.sink.clear_source(status.worker, status.dp_rank)
                tracker.restarted()
                verdict = tracker.classify(seq, digest)
            if verdict is Verdict.DUPLICATE:
                status.duplicates += 1
            elif verdict is Verdict.APPLY:
                pending.append((seq, payload))
                tracker.applied(seq, digest)
            elif verdict is Verdict.GAP:
                self._apply(status, pending)
                pending = []
                status.gaps += 1
                self._replay(status, tracker.last + 1, trigger=seq)
                verdict = tracker.classify(seq, digest)
                if verdict is Verdict.APPLY or verdict is Verdict.GAP:  # GAP: stale, start over
                    pending.append((seq, payload))
                    tracker.applied(seq, digest)
                else:
                    status.duplicates += 1
        self._apply(status, pending)

    def _probe_restart(self, status: SourceStatus) -> None:
        """After a new connection: does the engine still hold our last applied batch?"""
        status.restart_probe = False
        tracker = status.tracker
        last, digest = tracker.last, tracker.last_digest
        assert status.replay_endpoint is not None
        status.replays += 1
        try:
            result = fetch_replay(self.ctx, status.replay_endpoint, last, self.replay_timeout_s)
        except ReplayError as exc:
            status.replay_failures += 1
            log.warning("kv events: restart probe of worker %d failed: %s", status.worker, exc)
            return
        head = next(((s, p) for s, p in result.batches if s >= last), None)
        if head is None or (
            head[0] == last and digest is not None and xxhash.xxh3_64_intdigest(head[1]) != digest
        ):
            status.restarts += 1
            log.warning(
                "kv events: worker %d rank %d restarted (its replay socket no longer holds "
                "seq %d as applied); clearing it and replaying its new life",
                status.worker,
                status.dp_rank,
                last,
            )
            self.sink.clear_source(status.worker, status.dp_rank)
            tracker.restarted()
            self._replay(status, 0, trigger=None)
            return
        newer = [(s, p) for s, p in result.batches if s > last]
        self._take_replay(status, last + 1, None, newer)

    def _replay(self, status: SourceStatus, start: int, trigger: int | None) -> None:
        """Fill [start, trigger) from the replay socket, or mark the source stale."""
        if not status.replay_endpoint:
            if trigger is not None:
                self._mark_stale(status, f"gap before seq {trigger} and no replay socket")
            return
        status.replays += 1
        try:
            result = fetch_replay(self.ctx, status.replay_endpoint, start, self.replay_timeout_s)
        except ReplayError as exc:
            status.replay_failures += 1
            if trigger is not None:
                self._mark_stale(status, str(exc))
            else:
                log.warning("kv events: initial replay of worker %d failed: %s", status.worker, exc)
            return
        self._take_replay(status, start, trigger, result.batches)

    def _take_replay(
        self,
        status: SourceStatus,
        start: int,
        trigger: int | None,
        replayed: list[tuple[int, bytes]],
    ) -> None:
        """Apply replayed batches from `start` on, or mark the source stale if they do not
        reach `trigger` (or, with no trigger, do not start at `start`)."""
        batches = [(s, p) for s, p in replayed if s >= start]
        covers = bool(batches) and batches[0][0] == start
        if trigger is not None:
            covers = covers and batches[-1][0] >= trigger - 1
        elif not batches:
            covers = True  # nothing new since `start`
        contiguous = all(b[0] == a[0] + 1 for a, b in itertools.pairwise(batches))
        if not (covers and contiguous):
            status.replay_failures += 1
            first = batches[0][0] if batches else None
            why = f"replay from seq {start} starts at {first}: the engine's buffer is too short"
            self._mark_stale(status, why)
            status.tracker.restarted()
        if batches:
            self._apply(status, batches)
            status.replayed_batches += len(batches)
            status.tracker.replayed({s: xxhash.xxh3_64_intdigest(p) for s, p in batches})

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

    def _expire_stale(self) -> None:
        now = time.monotonic()
        for status in list(self.sources.values()):
            if status.stale and now - status.stale_since >= self.stale_rebuild_s:
                status.stale = False
                self.sink.set_stale(status.worker, status.dp_rank, False)
                log.info("kv events: worker %d rank %d rebuilt", status.worker, status.dp_rank)

    def _apply(self, status: SourceStatus, items: list[tuple[int, bytes]]) -> None:
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

    def _apply_slice(self, status: SourceStatus, items: list[tuple[int, bytes]]) -> None:
        while items:
            payloads = [p for _, p in items]
            seqs = [q for q, _ in items]
            try:
                if self._sink_takes_seqs and min(seqs) >= 0:
                    # a persistent index records them: after a restart, replay from there
                    stats = self.sink.ingest(status.worker, payloads, status.dp_rank, seqs=seqs)  # type: ignore[call-arg]
                else:
                    stats = self.sink.ingest(status.worker, payloads, status.dp_rank)
            except EventDecodeError as exc:
                bad = _failed_batch_index(exc, len(payloads))
                status.decode_errors += 1
                log.warning(
                    "kv events: worker %d rank %d: undecodable batch skipped: %s",
                    status.worker,
                    status.dp_rank,
                    exc,
                )
                if bad is None:
                    return  # cannot tell what was applied; the rest is lost (counted)
                status.applied_batches += bad
                partial = getattr(exc, "stats", None)
                if isinstance(partial, ApplyStats):
                    status.apply += partial
                items = items[bad + 1 :]
                continue
            status.applied_batches += len(payloads)
            status.apply += stats
            return

    # -- lifecycle and observation -------------------------------------------------------

    def wait_idle(self, timeout_s: float = 5.0) -> bool:
        """Block until the queue is drained (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._queue.empty() and self._idle.wait(0.05) and self._queue.empty():
                return True
        return False

    def stats(self) -> IngestorStats:
        out = IngestorStats(queue_depth=self._queue.qsize(), queue_bytes=self._queued_bytes)
        for s in list(self.sources.values()):
            out.received += s.received
            out.dropped += s.dropped
            out.applied_batches += s.applied_batches
            out.blocks_stored += s.apply.blocks_stored
            out.blocks_removed += s.apply.blocks_removed
            out.gaps += s.gaps
            out.replays += s.replays
            out.replay_failures += s.replay_failures
            out.stale_marks += s.stale_marks
            out.stale_sources += s.stale
            out.restarts += s.restarts
            out.decode_errors += s.decode_errors
            out.tail_checks += s.tail_checks
            out.tail_replayed_batches += s.tail_replayed_batches
        return out

    def close(self) -> None:
        with self._lock:
            receivers = list(self._receivers.values())
            self._receivers.clear()
        for r in receivers:
            r.stop()
        self._stop.set()
        self._thread.join(timeout=2.0)
