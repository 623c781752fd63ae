"""`NativeIndex`: the Rust residency index behind the `IndexBackend` protocol.

A thin wrapper: input validation and conversion of the binding's tuples (stats,
entries) into the protocol's dataclasses; `match` gets `Match` objects from the
binding as they are. The work (decode, apply, match, scan) runs in Rust with the
GIL released; see `docs/index.md` for the data structure and its numbers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from quillcache import _native
from quillcache.errors import EventDecodeError, QuillCacheError
from quillcache.index.inputs import (
    InvalidIndexInputError,
    as_key_array,
    check_medium,
    check_source,
)
from quillcache.index.protocol import KeyArray
from quillcache.index.types import (
    ApplyStats,
    Entry,
    IndexStats,
    Match,
    MatchColumns,
    Residency,
    SourceId,
)

_new = object.__new__

#: The largest capacity hint `reserve` takes (`MAX_RESERVE_BLOCKS` in Rust).
MAX_RESERVE_BLOCKS = 1 << 26


def _apply_stats(t: tuple[int, int, int, int, int, int, int, int]) -> ApplyStats:
    # Filling __dict__ directly: a third of the cost of ApplyStats(*t), per apply call.
    s = _new(ApplyStats)
    d = s.__dict__
    (
        d["batches"],
        d["events"],
        d["blocks_stored"],
        d["blocks_removed"],
        d["clears"],
        d["orphan_blocks"],
        d["unknown_removals"],
        d["invalid_events"],
    ) = t
    return s


def _entry(t: tuple[int, int, int, list[tuple[int, int, str, int]], bool]) -> Entry:
    key, parent, depth, holders, pinned = t
    return Entry(key, parent, depth, tuple(Residency(*h) for h in holders), pinned)


def _checked_items(
    items: Sequence[tuple[int, Sequence[bytes]]], dp_rank: int
) -> list[tuple[int, list[bytes]]]:
    """`apply_many`'s items as the native call takes them, or the typed error naming
    the first bad one (nothing is applied before the check)."""
    out = []
    for at, item in enumerate(items):
        try:
            worker, payloads = item
            check_source(worker, dp_rank)
            out.append((worker, [p if type(p) is bytes else bytes(p) for p in payloads]))
        except (TypeError, ValueError) as exc:
            if isinstance(exc, InvalidIndexInputError):
                raise InvalidIndexInputError(f"item {at}: {exc}") from None
            msg = f"item {at}: expected (worker, [bytes-like payloads]): {exc}"
            raise InvalidIndexInputError(msg) from None
    return out


class NativeIndex:
    """`IndexBackend` over `quillcache._native.NativeIndex`."""

    name = "native"
    thread_safe = True  # an RwLock in Rust, taken with the GIL released

    @classmethod
    def unavailable(cls) -> str | None:
        return None  # built in: always usable

    def __init__(self, *, _inner: _native.NativeIndex | None = None) -> None:
        self._inner = _inner if _inner is not None else _native.NativeIndex()

    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None:
        check_source(worker, dp_rank)
        self._inner.register_source(worker, dp_rank, model=model, tokenizer=tokenizer)

    def apply(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        *,
        seqs: Sequence[int] | None = None,  # kept only by the persistent subclass
    ) -> ApplyStats:
        # The per-call cost matters (a connector calls this for every few payloads):
        # plain ints go straight to Rust, which range-checks them (OverflowError);
        # anything else, or an error, takes the checking path for the typed error.
        if type(worker) is not int or type(dp_rank) is not int:
            check_source(worker, dp_rank)
        try:
            try:  # fast path: a sequence of bytes goes to Rust as it is
                raw = self._inner.apply(worker, payloads, dp_rank)
            except (TypeError, OverflowError):  # nothing was applied
                check_source(worker, dp_rank)
                try:  # bytearray, memoryview, ...
                    batch = [p if type(p) is bytes else bytes(p) for p in payloads]
                except TypeError as exc:
                    msg = f"payloads must be bytes-like: {exc}"
                    raise InvalidIndexInputError(msg) from None
                raw = self._inner.apply(worker, batch, dp_rank)
        except EventDecodeError as err:
            err.stats = ApplyStats(*err.stats)
            raise
        return _apply_stats(raw)

    def apply_many(
        self, items: Sequence[tuple[int, Sequence[bytes]]], dp_rank: int = 0
    ) -> ApplyStats:
        """`apply` for many `(worker, payloads)` items in order: one call, the GIL
        released once. A large list (64 KiB of payloads or more) is decoded on a second
        thread while this one applies, and the index's write lock is taken per window
        of ~8,192 blocks, never for the whole list. On a batch that does not
        decode, raises `EventDecodeError` with `item_index`, `payload_index` and the
        `stats` of everything applied before it (which stays applied)."""
        if type(dp_rank) is not int:
            check_source(0, dp_rank)
        try:
            try:  # fast path: a list of (int, list of bytes) goes to Rust as it is
                raw = self._inner.apply_many(items, dp_rank)
            # Raised while converting the arguments, before anything is applied (a
            # decode error is an EventDecodeError, which is none of these).
            except (TypeError, ValueError, OverflowError):
                raw = self._inner.apply_many(_checked_items(items, dp_rank), dp_rank)
        except EventDecodeError as err:
            err.stats = ApplyStats(*err.stats)
            raise
        return _apply_stats(raw)

    def match(self, keys: KeyArray) -> list[Match]:
        # The binding returns shared `Match` objects (rust/python/src/matches.rs).
        try:  # fast path: already a contiguous 1-D uint64 array
            return self._inner.match(keys)
        except (TypeError, QuillCacheError):
            return self._inner.match(as_key_array(keys))

    def match_columns(self, keys: KeyArray) -> MatchColumns:
        try:
            cols = self._inner.match_columns(keys)
        except (TypeError, QuillCacheError):
            cols = self._inner.match_columns(as_key_array(keys))
        worker, rank, medium, blocks, others = cols
        return MatchColumns(worker, rank, medium, blocks, tuple(others))

    def match_tiers(
        self,
        keys: KeyArray,
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,
    ) -> tuple[npt.NDArray[np.int64], MatchColumns]:
        try:
            tiers, cols, floors, positions = self._inner.match_tiers(
                keys, position, candidates, rank_counts, all_live=all_live
            )
        except (TypeError, QuillCacheError):
            tiers, cols, floors, positions = self._inner.match_tiers(
                as_key_array(keys), position, candidates, rank_counts, all_live=all_live
            )
        worker, rank, medium, blocks, others = cols
        return tiers.reshape(3, candidates), MatchColumns(
            worker, rank, medium, blocks, tuple(others), tuple(floors), positions
        )

    def match_many(self, requests: Sequence[KeyArray]) -> list[list[Match]]:
        """`match` for many requests in one call (one GIL release)."""
        return self._inner.match_many([as_key_array(k) for k in requests])

    def remove_worker(self, worker: int) -> int:
        check_source(worker, 0)
        return self._inner.remove_worker(worker)

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        check_source(worker, dp_rank)
        return self._inner.clear_source(worker, dp_rank)

    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int:
        check_source(worker, dp_rank)
        return self._inner.clear_medium(worker, dp_rank, check_medium(medium))

    def scan(self, prefix: KeyArray) -> list[Entry]:
        return [_entry(t) for t in self._inner.scan(as_key_array(prefix))]

    def entries(self) -> Iterator[Entry]:
        return (_entry(t) for t in self._inner.entries())

    def pin(self, keys: KeyArray) -> None:
        self._inner.pin(as_key_array(keys))

    def unpin(self, keys: KeyArray) -> None:
        self._inner.unpin(as_key_array(keys))

    def reserve(self, blocks: int) -> None:
        """Pre-size for `blocks` blocks in all: a capacity hint (e.g. the engines'
        cache sizes), so that ingest up to that size never re-places the tables.
        The memory is taken now; the index still grows beyond the hint."""
        if not isinstance(blocks, (int, np.integer)) or not 0 <= blocks <= MAX_RESERVE_BLOCKS:
            raise InvalidIndexInputError(
                f"blocks must be an integer in 0 .. {MAX_RESERVE_BLOCKS}, got {blocks!r}"
            )
        self._inner.reserve(int(blocks))

    def last_seqs(self) -> dict[SourceId, int]:
        return {}  # in memory only: nothing to resume from after a restart

    def stats(self) -> IndexStats:
        blocks, nodes, pairs, sources, pinned, spilled, memory, folded = self._inner.stats()
        return IndexStats(
            blocks=blocks,
            resident_pairs=pairs,
            sources=sources,
            memory_bytes=memory,
            extra={
                "nodes": nodes,
                "pinned": pinned,
                "spilled": spilled,
                "media_folded": folded,
            },
        )

    # --- persistence hooks -----------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole state as a versioned, checksummed binary snapshot."""
        return self._inner.snapshot()

    @classmethod
    def from_snapshot(cls, data: bytes) -> NativeIndex:
        """Restore from `snapshot()` bytes; corrupt data raises QuillCacheError."""
        return cls(_inner=_native.NativeIndex.from_snapshot(data))

    def state_eq(self, other: NativeIndex) -> bool:
        return self._inner.state_eq(other._inner)

    def close(self) -> None:
        """Nothing to release (the Rust index is freed with this object)."""
