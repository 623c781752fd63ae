"""The peer snapshot's wire format: one replica's index image and where each of its
event sources stood when the image was taken (docs/gateway.md, "Cold start from a peer").

    magic    8 bytes   b"QCPEERSN"
    version  u32 BE    FORMAT_VERSION
    hlen     u32 BE    length of the header (at most MAX_HEADER_BYTES)
    header   hlen      JSON: SnapshotHeader
    ilen     u64 BE    length of the image
    image    ilen      the native index's own snapshot (versioned, CRC-32 checked in Rust)
    digest   16 bytes  xxh3-128 of everything before it

The digest catches a truncated or damaged transfer before anything is parsed further;
the version is checked first so that an older replica refuses a newer format by name
rather than as corruption. Pure functions: no sockets, no index.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import xxhash

MAGIC = b"QCPEERSN"
FORMAT_VERSION = 1
MAX_HEADER_BYTES = 16 << 20
_PREFIX = struct.Struct(">8sII")  # magic, version, header length
_IMAGE_LEN = struct.Struct(">Q")
DIGEST_BYTES = 16


class SnapshotError(Exception):
    """A peer snapshot that cannot be used; `reason` is the metric label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class SourceEntry:
    """One event source of the peer (one rank of one engine) as the image holds it."""

    worker: int  # the peer's worker id: the image's name for the engine
    url: str  # the engine's base URL: what the joiner matches
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None
    last_seq: int  # the last batch the image holds
    digest: int | None  # xxh3 of that batch: the same seq with other bytes = another life
    exact: bool  # usable: the image holds exactly the stream up to last_seq
    why: str = ""  # why not exact


@dataclass(frozen=True)
class SnapshotHeader:
    secret_fingerprint: str
    block_size: int
    tokenizer_id: str
    created_unix: float
    blocks: int
    sources: list[SourceEntry] = field(default_factory=list)
    format: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> SnapshotHeader:
        try:
            data = json.loads(raw)
            sources = [SourceEntry(**s) for s in data.pop("sources")]
            header = cls(sources=sources, **data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise SnapshotError("corrupt", f"snapshot header unreadable: {exc}") from None
        if not isinstance(header.block_size, int) or not isinstance(header.blocks, int):
            raise SnapshotError("corrupt", "snapshot header: block_size and blocks must be ints")
        for s in header.sources:
            if not (
                all(_is_int(v) for v in (s.worker, s.dp_rank, s.last_seq))
                and s.worker >= 0
                and s.dp_rank >= 0
                and (s.digest is None or _is_int(s.digest))
                and isinstance(s.url, str)
                and isinstance(s.endpoint, str)
                and (s.replay_endpoint is None or isinstance(s.replay_endpoint, str))
                and isinstance(s.exact, bool)
            ):
                raise SnapshotError("corrupt", f"snapshot header: a source of bad types: {s}")
        return header


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class PeerSnapshot:
    header: SnapshotHeader
    image: bytes


def encode(header: SnapshotHeader, image: bytes) -> list[bytes]:
    """The snapshot as parts to write one after the other (the image is not copied)."""
    head = header.to_json()
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"snapshot header of {len(head)} bytes over {MAX_HEADER_BYTES}")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(head)) + head + _IMAGE_LEN.pack(len(image))
    h = xxhash.xxh3_128()
    h.update(prefix)
    h.update(image)
    return [prefix, image, h.digest()]


def chunks(parts: list[bytes], size: int = 1 << 20) -> Iterator[bytes]:
    """The parts in pieces of at most `size` bytes (memoryviews: no copies)."""
    for part in parts:
        view = memoryview(part)
        for at in range(0, len(view), size):
            yield bytes(view[at : at + size])


def check_prefix(data: bytes | bytearray) -> None:
    """Refuse early, on the first bytes, what is not a snapshot of this format."""
    if len(data) >= 8 and bytes(data[:8]) != MAGIC:
        raise SnapshotError("corrupt", "not a QuillCache peer snapshot (bad magic)")
    if len(data) >= 12:
        version = struct.unpack(">I", bytes(data[8:12]))[0]
        if version != FORMAT_VERSION:
            raise SnapshotError(
                "version",
                f"peer snapshot format {version}; this gateway reads format {FORMAT_VERSION} "
                "(replicas of one fleet must run releases with the same snapshot format)",
            )


def decode(data: bytes | bytearray) -> PeerSnapshot:
    """Parse and verify a whole snapshot; raises `SnapshotError` naming what is wrong."""
    if len(data) < _PREFIX.size:
        raise SnapshotError("truncated", f"peer snapshot of {len(data)} bytes: truncated")
    check_prefix(data)
    _, _, hlen = _PREFIX.unpack_from(data, 0)
    if hlen > MAX_HEADER_BYTES:
        raise SnapshotError("corrupt", f"snapshot header length {hlen} over {MAX_HEADER_BYTES}")
    at = _PREFIX.size + hlen
    if len(data) < at + _IMAGE_LEN.size:
        raise SnapshotError("truncated", "peer snapshot truncated in its header")
    (ilen,) = _IMAGE_LEN.unpack_from(data, at)
    at += _IMAGE_LEN.size
    end = at + ilen
    if len(data) < end + DIGEST_BYTES:
        raise SnapshotError(
            "truncated",
            f"peer snapshot truncated: {len(data)} bytes of {end + DIGEST_BYTES}",
        )
    if len(data) > end + DIGEST_BYTES:
        raise SnapshotError("corrupt", "peer snapshot has bytes after its digest")
    view = memoryview(data)
    if xxhash.xxh3_128_digest(view[:end]) != bytes(view[end:]):
        raise SnapshotError("corrupt", "peer snapshot checksum mismatch (damaged in transfer)")
    header = SnapshotHeader.from_json(bytes(view[_PREFIX.size : _PREFIX.size + hlen]))
    if header.format != FORMAT_VERSION:
        raise SnapshotError("version", f"snapshot header says format {header.format}")
    return PeerSnapshot(header, bytes(view[at:end]))
