"""SGLang's KV-event wire format, release by release, and an encoder that writes it
byte for byte (the engine simulator's `--flavor sglang`; the tests).

Read from `sglang/srt/disaggregation/kv_events.py` in SGLang's wheels (golden frames
of each shape: `tests/vectors/sglang_kv_events.json`, with how they were made). Every
release encodes with msgspec; `EventBatch` is always the array ``[ts, events,
attn_dp_rank]`` (msgspec writes every field of an array-like struct, so the rank is
there, nil when unset; the publisher sets it). What changed:

========  =====================================================================
0.4.7     first release with KV events: events are tagged **arrays**
          ``["BlockStored", hashes, parent, token_ids, block_size, lora_id]``,
          ``["BlockRemoved", hashes]``, ``["AllBlocksCleared"]``
0.5.9     ``medium`` appended to both (nil when unset)
0.5.18    a salted store appends the map ``{"cache_salt": salt}`` after ``medium``
0.5.20    events are tagged **maps** like vLLM's; optional ``medium``,
          ``cache_salt``, ``session_id`` omitted when unset
0.5.22    ``lora_name`` added; replay replies carry the topic frame
========  =====================================================================

Engine hashes are signed 64-bit ints in every release.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from quillcache.events.types import AllBlocksCleared, BlockRemoved, BlockStored, Event

_I64 = 1 << 63
_U64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SglangWire:
    """What the SGLang releases from `first` on (until the next entry) send."""

    first: str
    maps: bool  # events as tagged maps (else tagged arrays)
    medium: bool  # BlockStored / BlockRemoved declare `medium`
    salt_metadata: bool  # array form: a salted store appends {"cache_salt": salt}
    optional: tuple[str, ...]  # BlockStored's optional map fields, in declared order
    replay_topic: bool  # replay replies are [b"", topic, seq, payload] (else no topic)


#: Oldest first. `first` is the first release of each shape (see the module docstring).
RELEASES: tuple[SglangWire, ...] = (
    SglangWire("0.4.7", False, False, False, (), False),
    SglangWire("0.5.9", False, True, False, (), False),
    SglangWire("0.5.18", False, True, True, (), False),
    SglangWire("0.5.20", True, True, False, ("medium", "cache_salt", "session_id"), False),
    SglangWire(
        "0.5.22", True, True, False, ("medium", "cache_salt", "session_id", "lora_name"), True
    ),
)
#: The last release whose events are arrays, the first whose events are maps.
LAST_ARRAY_RELEASE = "0.5.19"
FIRST_MAP_RELEASE = "0.5.20"


def _version(text: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)(?:\.post\d+)?", text.strip())
    if m is None:
        raise ValueError(f"not an SGLang release number: {text!r} (e.g. 0.5.23)")
    major, minor, patch = (int(g) for g in m.groups())
    return major, minor, patch


def wire_of(release: str) -> SglangWire:
    """The wire format SGLang `release` (e.g. ``"0.5.23"``) sends; ValueError for a
    malformed release or one older than the first with KV events."""
    version = _version(release)
    if version < _version(RELEASES[0].first):
        raise ValueError(f"SGLang {release} publishes no KV events (first: {RELEASES[0].first})")
    return [w for w in RELEASES if _version(w.first) <= version][-1]


def _signed(h: int) -> int:
    """SGLang's int64 for an engine hash given as decoded (0..2**64-1) or signed."""
    if not -_I64 <= h <= _U64:
        raise ValueError(f"engine hash {h} is outside int64/uint64")
    return h - (1 << 64) if h >= _I64 else h


def _hashes(values: Sequence[int | bytes]) -> list[int]:
    out = []
    for h in values:
        if not isinstance(h, int):
            raise TypeError("SGLang sends int hashes only")
        out.append(_signed(h))
    return out


def _event_fields(event: Event, wire: SglangWire) -> tuple[str, list[tuple[str, Any]]]:
    """(tag, [(name, value)]) in SGLang's declared order; None = nil / omitted."""
    if isinstance(event, BlockStored):
        parent = event.parent_block_hash
        if parent is not None and not isinstance(parent, int):
            raise TypeError("SGLang sends int hashes only")
        fields: list[tuple[str, Any]] = [
            ("block_hashes", _hashes(event.block_hashes)),
            ("parent_block_hash", None if parent is None else _signed(parent)),
            ("token_ids", list(event.token_ids)),
            ("block_size", event.block_size),
            ("lora_id", event.lora_id),
        ]
        names = wire.optional if wire.maps else (("medium",) if wire.medium else ())
        fields += [(n, getattr(event, n)) for n in names]
        return event.TAG, fields
    if isinstance(event, BlockRemoved):
        fields = [("block_hashes", _hashes(event.block_hashes))]
        if wire.medium:
            fields.append(("medium", event.medium))
        return event.TAG, fields
    if isinstance(event, AllBlocksCleared):
        return event.TAG, []
    raise TypeError(f"not an event: {event!r}")


_REQUIRED = frozenset(["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"])


def encode_event(event: Event, wire: SglangWire) -> bytes:
    """msgpack bytes of one event as SGLang releases of `wire` write it."""
    tag, fields = _event_fields(event, wire)
    packer = msgpack.Packer(use_bin_type=True)
    if wire.maps:  # msgspec omit_defaults: optional fields left None are not written
        items = [(n, v) for n, v in fields if n in _REQUIRED or v is not None]
        out = [packer.pack_map_header(1 + len(items)), packer.pack("type"), packer.pack(tag)]
        for name, value in items:
            out += [packer.pack(name), packer.pack(value)]
        return b"".join(out)
    values = [v for _, v in fields]
    salt = event.cache_salt if isinstance(event, BlockStored) else None
    if wire.salt_metadata and salt is not None:
        values.append({"cache_salt": salt})
    return (
        packer.pack_array_header(1 + len(values))
        + packer.pack(tag)
        + b"".join(packer.pack(v) for v in values)
    )


def encode_batch(
    events: Sequence[Event], ts: float, dp_rank: int | None, wire: SglangWire
) -> bytes:
    """One batch as SGLang publishes it: ``[ts, [events...], attn_dp_rank]``."""
    packer = msgpack.Packer(use_bin_type=True)
    parts = [packer.pack_array_header(3), packer.pack(float(ts))]
    parts.append(packer.pack_array_header(len(events)))
    parts += [encode_event(e, wire) for e in events]
    parts.append(packer.pack(dp_rank))
    return b"".join(parts)


#: SGLang's names for the tiers the simulator models (`StorageMedium`).
MEDIUM_NAMES = {"GPU": "GPU", "CPU": "CPU_PINNED", "DISK": "DISK", "STORAGE": "DISK"}


def sglang_medium(medium: str | None) -> str | None:
    """The medium name SGLang would send for one of ours (others unchanged)."""
    return None if medium is None else MEDIUM_NAMES.get(medium, medium)
