"""Client of an engine's replay socket (a ZMQ ROUTER): ask for every batch from a seq on.

Request `[b"", start_seq (8 bytes BE)]` from a DEALER (a REQ would only get the first
reply). Replies are `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang) or
`[b"", seq, payload]` (older vLLM), then an end marker whose seq is all ones.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Generator
from dataclasses import dataclass, field

import xxhash
import zmq

REPLAY_RCVHWM = 10_000  # vLLM's default replay buffer (`buffer_steps`)
END_SEQ = 0xFFFF_FFFF_FFFF_FFFF


class ReplayError(Exception):
    """The replay socket did not answer in time or answered something unreadable."""


@dataclass
class ReplayResult:
    batches: list[tuple[int, bytes]] = field(default_factory=list)  # (seq, payload), in order
    complete: bool = False  # the end marker arrived


def parse_reply(frames: list[bytes]) -> tuple[int, bytes] | None:
    """(seq, payload) of one reply, None for the end marker; either layout."""
    if len(frames) == 4:  # [b"", topic, seq, payload]
        seq_frame, payload = frames[2], frames[3]
    elif len(frames) == 3:  # [b"", seq, payload]
        seq_frame, payload = frames[1], frames[2]
    else:
        raise ReplayError(f"replay reply with {len(frames)} frames; expected 3 or 4")
    if frames[0] != b"":
        raise ReplayError("replay reply without the empty delimiter frame")
    if len(seq_frame) != 8:
        raise ReplayError(f"replay seq frame of {len(seq_frame)} bytes; expected 8")
    seq = int.from_bytes(seq_frame, "big")
    if seq == END_SEQ:
        return None
    return seq, payload


class ReplayStream:
    """One replay request, read as it streams in: chunks of (seq, payload) in order.

    The reader stops at `stop_seq` (inclusive) when given: a gap needs exactly the
    batches before the seq that revealed it, the rest is queued or still to come, so
    reading on would only fetch what is applied anyway. `idle_timeout_s` bounds the wait
    for the next frame, not the whole transfer: a long replay that keeps flowing is read
    to its end. Chunks are bounded in batches and bytes, so a caller that applies each
    before asking for the next holds one chunk at a time, however long the replay.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        start_seq: int,
        idle_timeout_s: float = 2.0,
        *,
        stop_seq: int | None = None,
        chunk_batches: int = 1024,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.start_seq = start_seq
        self.idle_timeout_s = idle_timeout_s
        self.stop_seq = stop_seq
        self.chunk_batches = chunk_batches
        self.chunk_bytes = chunk_bytes
        self.complete = False  # the end marker arrived
        self.reached_stop = False  # `stop_seq` arrived (the socket was closed there)
        self.received = 0  # batches read (including any before `start_seq`)

    def chunks(self) -> Generator[list[tuple[int, bytes]], None, None]:
        """Raises `ReplayError` when nothing at all arrives in `idle_timeout_s`, or on a
        reply that cannot be read; a stream that stops flowing later just ends."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # room for a whole vLLM-sized replay buffer: beyond its pipe's high-water mark
        # the engine's ROUTER drops replies, and every hole costs one more request
        sock.setsockopt(zmq.RCVHWM, REPLAY_RCVHWM)
        idle_ms = max(1, int(self.idle_timeout_s * 1000))
        try:
            sock.connect(self.endpoint)
            sock.send_multipart([b"", self.start_seq.to_bytes(8, "big")])
            while True:
                if not sock.poll(idle_ms):
                    if not self.received and not self.complete:
                        raise ReplayError(
                            f"no answer from replay socket {self.endpoint} "
                            f"in {self.idle_timeout_s}s"
                        )
                    return  # stopped flowing: the caller sees it did not reach its end
                chunk: list[tuple[int, bytes]] = []
                size = 0
                while len(chunk) < self.chunk_batches and size < self.chunk_bytes:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    item = parse_reply(frames)
                    if item is None:
                        self.complete = True
                        break
                    self.received += 1
                    chunk.append(item)
                    size += len(item[1])
                    if self.stop_seq is not None and item[0] >= self.stop_seq:
                        self.reached_stop = True
                        break
                if chunk:
                    yield chunk
                if self.complete or self.reached_stop:
                    return
        finally:
            sock.close(0)


def fetch_replay(
    ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 2.0
) -> ReplayResult:
    """Every buffered batch with seq >= `start_seq`, until the end marker or no frame for
    `timeout_s`, in one list (for tools; the ingestor streams with `ReplayStream`).

    Raises `ReplayError` when nothing at all arrives (no replay socket there).
    """
    stream = ReplayStream(ctx, endpoint, start_seq, timeout_s)
    result = ReplayResult()
    for chunk in stream.chunks():
        result.batches.extend(chunk)
    result.complete = stream.complete
    return result


def batch_digest(payload: bytes) -> int:
    """The xxh3 digest of one batch's bytes: what tells two engine lives apart at one seq."""
    return xxhash.xxh3_64_intdigest(payload)


class Holding(enum.Enum):
    """What an engine's replay socket says of one (seq, digest) a gateway applied."""

    HELD = "held"  # it still holds that seq with the same bytes: the same engine life
    OTHER_BYTES = "other_bytes"  # it holds that seq with other bytes: it restarted
    NOT_PUBLISHED = "not_published"  # its stream ends before that seq: it restarted
    BUFFER_MOVED_ON = "buffer_moved_on"  # its buffer starts after that seq
    NO_ANSWER = "no_answer"  # the replay socket did not answer (or answered nonsense)


def probe_holding(
    ctx: zmq.Context, endpoint: str, seq: int, digest: int, timeout_s: float = 2.0
) -> Holding:
    """Ask the replay socket for `seq` alone and compare its bytes with `digest`. A replay
    from `seq` + 1 then covers everything after it only when this says HELD: the seq
    numbering is per engine process, so the same seq with other bytes is another life."""
    stream = ReplayStream(ctx, endpoint, seq, timeout_s, stop_seq=seq)
    try:
        with contextlib.closing(stream.chunks()) as chunks:
            for chunk in chunks:
                first, payload = chunk[0]
                if first > seq:
                    return Holding.BUFFER_MOVED_ON
                if first < seq:  # a socket that ignores the start seq: not trusted
                    return Holding.NO_ANSWER
                return Holding.HELD if batch_digest(payload) == digest else Holding.OTHER_BYTES
    except ReplayError:
        return Holding.NO_ANSWER
    return Holding.NOT_PUBLISHED if stream.complete else Holding.NO_ANSWER
