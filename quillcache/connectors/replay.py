"""Client of an engine's replay socket (a ZMQ ROUTER): ask for every batch from a seq on.

Request `[b"", start_seq (8 bytes BE)]` from a DEALER (a REQ would only get the first
reply). Replies are `[b"", topic, seq, payload]` (vLLM >= 0.26, SGLang) or
`[b"", seq, payload]` (older vLLM), then an end marker whose seq is all ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import zmq

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


def fetch_replay(
    ctx: zmq.Context, endpoint: str, start_seq: int, timeout_s: float = 2.0
) -> ReplayResult:
    """Every buffered batch with seq >= `start_seq`, until the end marker or the timeout.

    Raises `ReplayError` when nothing at all arrives (no replay socket there).
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    result = ReplayResult()
    try:
        sock.connect(endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        deadline = time.monotonic() + timeout_s
        got_any = False
        while True:
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            if remaining_ms <= 0 or not sock.poll(remaining_ms):
                if not got_any:
                    raise ReplayError(f"no answer from replay socket {endpoint} in {timeout_s}s")
                return result  # partial: the caller treats it as not covering the gap
            got_any = True
            item = parse_reply(sock.recv_multipart())
            if item is None:
                result.complete = True
                return result
            result.batches.append(item)
    finally:
        sock.close(0)
