"""Pure-Python reference decoder of KV-event batches (`docs/kv-events.md`).

An independent oracle for the Rust decoder (and the decoder of the pure-Python
`MemoryIndex`): same accepted shapes, same results (`quillcache.events.types`), same
rejections, with `EventDecodeError`. Written for clarity, not speed: it walks the
payload with msgpack's `Unpacker`, peeking each value's marker byte to decide how to
read it, so that skipping unknown values bounds the nesting depth exactly as the Rust
decoder does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgpack

from quillcache._native import EventDecodeError
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    ExtraKey,
    MmKey,
    RawKey,
    normalize_medium,
)

__all__ = ["MAX_DEPTH", "decode_batch"]

#: Deepest container nesting accepted anywhere (the batch array is depth 1).
MAX_DEPTH = 32

_U64 = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_U32_MAX = (1 << 32) - 1

_STORED_POSITIONAL = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
)
_REMOVED_POSITIONAL = ("block_hashes", "medium", "group_idx", "locality", "ownership")
_POSITIONAL = {
    "BlockStored": (_STORED_POSITIONAL, 4),
    "BlockRemoved": (_REMOVED_POSITIONAL, 1),
    "AllBlocksCleared": ((), 0),
}
_REQUIRED = {
    "BlockStored": ("block_hashes", "token_ids", "block_size"),
    "BlockRemoved": ("block_hashes",),
    "AllBlocksCleared": (),
}


def _is_array(marker: int) -> bool:
    return 0x90 <= marker <= 0x9F or marker in (0xDC, 0xDD)


def _is_map(marker: int) -> bool:
    return 0x80 <= marker <= 0x8F or marker in (0xDE, 0xDF)


def _is_str(marker: int) -> bool:
    return 0xA0 <= marker <= 0xBF or marker in (0xD9, 0xDA, 0xDB)


def _is_int(value: Any) -> bool:
    return type(value) is int  # msgpack's true/false decode to bool, a subclass of int


class _Reader:
    def __init__(self, payload: bytes) -> None:
        self.buf = payload
        self.unpacker = msgpack.Unpacker(
            None, raw=False, max_buffer_size=max(len(payload), 1), strict_map_key=False
        )
        self.unpacker.feed(payload)
        self.path = "batch"

    # -- errors ---------------------------------------------------------------------
    def fail(self, what: str, offset: int | None = None) -> EventDecodeError:
        at = self.unpacker.tell() if offset is None else offset
        err = EventDecodeError(f"{self.path}: {what} (at byte {at})")
        err.offset = at  # as the native decoder's exceptions carry it
        return err

    # -- primitives -----------------------------------------------------------------
    def peek(self) -> int:
        pos = self.unpacker.tell()
        if pos >= len(self.buf):
            raise self.fail("truncated: expected a value, found end of input")
        return self.buf[pos]

    def value(self) -> Any:
        return self.unpacker.unpack()

    def array_header(self, what: str) -> int:
        if not _is_array(self.peek()):
            raise self.fail(f"expected {what} (an array), found marker 0x{self.peek():02x}")
        n: int = self.unpacker.read_array_header()
        if n > len(self.buf) - self.unpacker.tell():
            raise self.fail(f"array declares {n} elements, more than the bytes left")
        return n

    def map_header(self) -> int:
        n: int = self.unpacker.read_map_header()
        if 2 * n > len(self.buf) - self.unpacker.tell():
            raise self.fail(f"map declares {n} entries, more than the bytes left")
        return n

    def string(self, what: str) -> str:
        if not _is_str(self.peek()):
            raise self.fail(f"expected {what} (a string), found marker 0x{self.peek():02x}")
        value: str = self.value()
        return value

    def nil_or(self, read: Callable[[], Any]) -> Any:
        if self.peek() == 0xC0:
            self.value()
            return None
        return read()

    def skip(self, depth: int) -> None:
        """Skips one value of any type, refusing containers nested deeper than MAX_DEPTH."""
        marker = self.peek()
        if _is_array(marker) or _is_map(marker):
            if depth > MAX_DEPTH:
                raise self.fail(f"nesting deeper than {MAX_DEPTH} levels")
            n = self.array_header("") if _is_array(marker) else 2 * self.map_header()
            for _ in range(n):
                self.skip(depth + 1)
        else:
            self.unpacker.skip()

    # -- fields ---------------------------------------------------------------------
    def int_in(self, what: str, lo: int, hi: int) -> int:
        start = self.unpacker.tell()
        value = self.value()
        if not _is_int(value) or not lo <= value <= hi:
            raise self.fail(f"expected {what} (an int in {lo}..{hi}), got {value!r:.40}", start)
        return value

    def engine_hash(self, value: Any, where: str, start: int) -> int:
        if _is_int(value):
            if not _I64_MIN <= value <= _U64:
                raise self.fail(f"{where}: int hash outside int64/uint64", start)
            return value & _U64
        if isinstance(value, bytes):
            if len(value) < 8:
                raise self.fail(f"{where}: digest of {len(value)} bytes, need at least 8", start)
            return int.from_bytes(value[-8:], "big")
        raise self.fail(
            f"{where}: expected an int or bytes hash, got {type(value).__name__}", start
        )

    def element_offset(self, array_start: int, index: int) -> int:
        """Byte offset of element `index` of the array at `array_start` (errors only)."""
        walker = msgpack.Unpacker(None, max_buffer_size=max(len(self.buf), 1))
        walker.feed(self.buf)
        walker.read_bytes(array_start)
        walker.read_array_header()
        for _ in range(index):
            walker.skip()
        offset: int = walker.tell()
        return offset

    def whole_array(self, what: str) -> list[Any]:
        """An array of scalars, read in one call (elements are type-checked by the caller)."""
        if not _is_array(self.peek()):
            raise self.fail(f"expected {what} (an array), found marker 0x{self.peek():02x}")
        values: list[Any] = self.value()
        return values

    def hash_list(self) -> tuple[int, ...]:
        start = self.unpacker.tell()
        values = self.whole_array("block_hashes")
        return tuple(
            v
            if _is_int(v) and 0 <= v <= _U64
            else self.engine_hash(v, f"block_hashes[{i}]", self.element_offset(start, i))
            for i, v in enumerate(values)
        )

    def optional_hash(self) -> int | None:
        start = self.unpacker.tell()
        value = self.value()
        return None if value is None else self.engine_hash(value, "parent_block_hash", start)

    def token_list(self) -> tuple[int, ...]:
        start = self.unpacker.tell()
        values = self.whole_array("token_ids")
        for i, t in enumerate(values):
            if not _is_int(t) or not 0 <= t <= _U32_MAX:
                raise self.fail(
                    f"token_ids[{i}]: expected an int in 0..2^32-1, got {t!r:.40}",
                    self.element_offset(start, i),
                )
        return tuple(values)

    def extra_keys(self) -> tuple[tuple[ExtraKey, ...] | None, ...]:
        blocks: list[tuple[ExtraKey, ...] | None] = []
        for _ in range(self.array_header("extra_keys")):
            if self.peek() == 0xC0:
                self.value()
                blocks.append(None)
                continue
            items: list[ExtraKey] = []
            for _ in range(self.array_header("a block's extra keys")):
                start = self.unpacker.tell()
                self.skip(6)  # batch > events > event > extra_keys > block > item
                items.append(_classify_extra_key(self.buf[start : self.unpacker.tell()]))
            blocks.append(tuple(items))
        return tuple(blocks)


def _classify_extra_key(raw: bytes) -> ExtraKey:
    try:
        value = msgpack.unpackb(raw, raw=False)
    except Exception:  # invalid UTF-8, odd ext types...: not a str nor an mm pair
        return RawKey(raw)
    if isinstance(value, str):
        return value
    if (
        isinstance(value, list)
        and len(value) == 2
        and isinstance(value[0], str)
        and _is_int(value[1])
        and _I64_MIN <= value[1] <= _I64_MAX
    ):
        return MmKey(value[0], value[1])
    return RawKey(raw)


def _read_field(r: _Reader, name: str, fields: dict[str, Any]) -> None:
    """Reads the value of field `name` into `fields`, or skips it if we do not use it."""
    readers: dict[str, Callable[[], Any]] = {
        "block_hashes": r.hash_list,
        "parent_block_hash": r.optional_hash,
        "token_ids": r.token_list,
        "block_size": lambda: r.int_in("block_size", 1, _U32_MAX),
        "lora_id": lambda: r.nil_or(lambda: r.int_in("lora_id", _I64_MIN, _I64_MAX)),
        "medium": lambda: r.nil_or(lambda: r.string("medium")),
        "lora_name": lambda: r.nil_or(lambda: r.string("lora_name")),
        "extra_keys": lambda: r.nil_or(r.extra_keys),
        "group_idx": lambda: r.nil_or(lambda: r.int_in("group_idx", 0, _U32_MAX)),
        "cache_salt": lambda: r.nil_or(lambda: r.string("cache_salt")),
    }
    read = readers.get(name)
    if read is None:
        r.skip(4)  # batch > events > event > value
    else:
        fields[name] = read()


def _sglang_metadata(r: _Reader, fields: dict[str, Any]) -> None:
    """SGLang 0.5.18-0.5.19 (`BlockStoredWithMetadata`): a salted store appends, after
    `medium`, the map ``{"cache_salt": str}`` where vLLM's positional form has
    `lora_name` (a str or nil, so the two are told apart by type). Other keys are
    skipped, as in an event map."""
    for _ in range(r.map_header()):
        key = r.string("a metadata key")
        if key == "cache_salt":
            fields["cache_salt"] = r.nil_or(lambda: r.string("cache_salt"))
        else:
            r.skip(5)  # batch > events > event > metadata > value


def _build(r: _Reader, kind: str, fields: dict[str, Any], start: int) -> Event:
    for name in _REQUIRED[kind]:
        if name not in fields:
            raise r.fail(f"{kind} is missing the required field {name!r}", start)
    if kind == "BlockStored":
        return BlockStored(
            block_hashes=fields["block_hashes"],
            parent_block_hash=fields.get("parent_block_hash"),
            token_ids=fields["token_ids"],
            block_size=fields["block_size"],
            lora_id=fields.get("lora_id"),
            medium=normalize_medium(fields.get("medium")),
            lora_name=fields.get("lora_name"),
            extra_keys=fields.get("extra_keys") or (),
            group_idx=fields.get("group_idx") or 0,
            cache_salt=fields.get("cache_salt"),
        )
    if kind == "BlockRemoved":
        return BlockRemoved(
            block_hashes=fields["block_hashes"],
            medium=normalize_medium(fields.get("medium")),
            group_idx=fields.get("group_idx") or 0,
        )
    return AllBlocksCleared()


def _check_kind(r: _Reader, kind: str, start: int) -> None:
    if kind not in _POSITIONAL:
        raise r.fail(f"unknown event type {kind!r:.60}", start)


def _event(r: _Reader, index: int) -> Event:
    start = r.unpacker.tell()
    r.path = f"events[{index}]"
    marker = r.peek()
    fields: dict[str, Any] = {}
    if _is_map(marker):
        kind: str | None = None
        for _ in range(r.map_header()):
            r.path = f"events[{index}]"
            name = r.string("a field name")
            r.path = f"events[{index}].{name:.60}"
            if name == "type":
                kind = r.string("the event type")
            else:
                _read_field(r, name, fields)
        r.path = f"events[{index}]"
        if kind is None:
            raise r.fail("event map has no 'type' key", start)
        _check_kind(r, kind, start)
        return _build(r, kind, fields, start)
    if _is_array(marker):
        n = r.array_header("an event")
        r.path = f"events[{index}]"
        if n == 0:
            raise r.fail("empty event array (expected the type name first)", start)
        kind = r.string("the event type")
        _check_kind(r, kind, start)
        names, minimum = _POSITIONAL[kind]
        if n - 1 < minimum:
            raise r.fail(f"{kind} array has {n - 1} fields, needs at least {minimum}", start)
        for i in range(n - 1):
            name = names[i] if i < len(names) else f"<extra {i}>"
            r.path = f"events[{index}].{name}"
            if name == "lora_name" and kind == "BlockStored" and _is_map(r.peek()):
                r.path = f"events[{index}].metadata"
                _sglang_metadata(r, fields)
            else:
                _read_field(r, name, fields)
        r.path = f"events[{index}]"
        return _build(r, kind, fields, start)
    raise r.fail(f"expected an event (a map or an array), found marker 0x{marker:02x}")


def _decode(r: _Reader) -> EventBatch:
    n = r.array_header("the batch")
    if n not in (2, 3):
        raise r.fail(f"batch has {n} elements, expected 2 or 3 ([ts, events, dp_rank])", 0)
    r.path = "batch.ts"
    start = r.unpacker.tell()
    ts = r.value()
    if not (isinstance(ts, float) or _is_int(ts)):
        raise r.fail(f"expected a float timestamp, got {type(ts).__name__}", start)
    r.path = "batch.events"
    events = tuple(_event(r, i) for i in range(r.array_header("the event list")))
    dp_rank = None
    if n == 3:
        r.path = "batch.dp_rank"
        dp_rank = r.nil_or(lambda: r.int_in("dp_rank", _I64_MIN, _I64_MAX))
    r.path = "batch"
    if r.unpacker.tell() != len(r.buf):
        raise r.fail(f"{len(r.buf) - r.unpacker.tell()} trailing bytes after the batch")
    return EventBatch(ts=float(ts), events=events, dp_rank=dp_rank)


def decode_batch(payload: bytes) -> EventBatch:
    """Decodes one event batch, raising `EventDecodeError` (what, where) on bad input."""
    r = _Reader(bytes(payload))
    try:
        return _decode(r)
    except EventDecodeError:
        raise
    except msgpack.OutOfData:
        raise r.fail("truncated: the payload ends inside a value") from None
    except (ValueError, TypeError, msgpack.FormatError, msgpack.StackError) as exc:
        # UnicodeDecodeError is a ValueError: invalid UTF-8 in a string we read.
        raise r.fail(f"malformed msgpack: {exc}") from None
