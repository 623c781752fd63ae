"""Plain value types shared by every index backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, order=True)
class SourceId:
    """One publisher of KV events: an engine (worker) and its data-parallel rank."""

    worker: int
    dp_rank: int = 0


@dataclass(frozen=True, order=True)
class Match:
    """The longest cached prefix, in blocks, that one source holds in one medium."""

    worker: int
    dp_rank: int
    medium: str
    blocks: int


#: `MatchColumns.medium` codes of the three named tiers; code 3 + i is other_media[i].
MEDIUM_CODES: dict[str, int] = {"GPU": 0, "CPU": 1, "DISK": 2}
_NAMED_MEDIA = ("GPU", "CPU", "DISK")


@dataclass(frozen=True, slots=True)
class MatchColumns:
    """`match` as arrays, one entry per (source, medium) hit in `match`'s order: what a
    router reads at fleet size without one Python object per hit. `medium` is a code:
    0 GPU, 1 CPU, 2 DISK, ``3 + i`` for ``other_media[i]``.

    Compact (what `match_tiers` returns): `floors` lists `(medium code, blocks)` that
    every live source of the index holds (a system prompt every engine has), and the
    arrays only the hits above their medium's floor, so that a fleet's shared first
    block is one entry, not one per engine. Empty `floors`: the arrays are the whole
    match."""

    worker: npt.NDArray[np.uint64]
    dp_rank: npt.NDArray[np.uint32]
    medium: npt.NDArray[np.uint16]
    blocks: npt.NDArray[np.uint32]
    other_media: tuple[str, ...] = ()
    floors: tuple[tuple[int, int], ...] = ()
    # each hit's position among the candidates `match_tiers` was given (-1: not one of
    # them); None when the backend did not place them
    positions: list[int] | None = None

    @classmethod
    def of(cls, matches: Sequence[Match]) -> MatchColumns:
        """The columns of a `match` list (backends that build `Match` objects)."""
        others: list[str] = []
        codes = []
        for m in matches:
            code = MEDIUM_CODES.get(m.medium)
            if code is None:
                if m.medium not in others:
                    others.append(m.medium)
                code = 3 + others.index(m.medium)
            codes.append(code)
        return cls(
            np.fromiter((m.worker for m in matches), np.uint64, len(matches)),
            np.fromiter((m.dp_rank for m in matches), np.uint32, len(matches)),
            np.asarray(codes, dtype=np.uint16),
            np.fromiter((m.blocks for m in matches), np.uint32, len(matches)),
            tuple(others),
        )

    def tiers(
        self,
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
    ) -> npt.NDArray[np.int64]:
        """Per candidate (rank 0 at `position[worker]`, negative or past the end: not
        one; rank r at `position[worker] + r` when `rank_counts` there is more than r,
        and no other rank without `rank_counts`), its longest prefix per tier: rows
        gpu, cpu, disk (a medium beyond GPU and CPU is disk)."""
        at = []
        for w, r in zip(self.worker.tolist(), self.dp_rank.tolist(), strict=True):
            p = int(position[w]) if w < len(position) else -1
            if 0 <= p < candidates and r:
                ranks = int(rank_counts[p]) if rank_counts is not None else 1
                p = p + r if r < ranks else -1
            at.append(p)
        return self.tiers_at(np.asarray(at, dtype=np.intp), candidates)

    def tiers_at(self, at: npt.NDArray[np.intp], candidates: int) -> npt.NDArray[np.int64]:
        """`tiers` given each hit's candidate position (-1: not a candidate)."""
        out = np.zeros((3, candidates), dtype=np.int64)
        for code, blocks in self.floors:  # every candidate is a live source
            row = out[min(code, 2)]
            np.maximum(row, blocks, out=row)
        ok = (at >= 0) & (at < candidates)
        if ok.any():
            tiers = np.minimum(self.medium[ok], 2).astype(np.intp)
            np.maximum.at(out, (tiers, at[ok]), self.blocks[ok].astype(np.int64))
        return out

    def medium_name(self, code: int) -> str:
        return _NAMED_MEDIA[code] if code < 3 else self.other_media[code - 3]

    def matches(self) -> list[Match]:
        """The hits as `Match` objects, as `match` returns them (of a compact match:
        the hits above the floors only)."""
        return [
            Match(int(w), int(r), self.medium_name(int(c)), int(b))
            for w, r, c, b in zip(self.worker, self.dp_rank, self.medium, self.blocks, strict=True)
        ]


@dataclass(frozen=True)
class Residency:
    """One (source, medium) holding a block, with how many physical copies."""

    worker: int
    dp_rank: int
    medium: str
    refcount: int


@dataclass(frozen=True)
class Entry:
    """One block of the index: its content key, its parent's, its depth and holders."""

    key: int
    parent: int  # the namespace id for a block at depth 0
    depth: int
    holders: tuple[Residency, ...]
    pinned: bool = False


@dataclass
class ApplyStats:
    """What applying event batches did (all counters, summed over the batches)."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    orphan_blocks: int = 0  # stored with an unknown parent or, without tokens, an unknown hash
    unknown_removals: int = 0  # BlockRemoved for a hash this source never stored
    invalid_events: int = 0  # well-formed msgpack that makes no sense (e.g. too few tokens)

    def __iadd__(self, other: ApplyStats) -> ApplyStats:
        # field by field, written out: this runs once per applied batch, and a loop of
        # getattr/setattr over the fields costs several times as much
        # (tests/index/test_apply_stats.py checks that every field is summed)
        self.batches += other.batches
        self.events += other.events
        self.blocks_stored += other.blocks_stored
        self.blocks_removed += other.blocks_removed
        self.clears += other.clears
        self.orphan_blocks += other.orphan_blocks
        self.unknown_removals += other.unknown_removals
        self.invalid_events += other.invalid_events
        return self


@dataclass(frozen=True)
class IndexStats:
    blocks: int  # distinct content keys in the index (including pinned-only ones)
    resident_pairs: int  # (block, source, medium) triples
    sources: int
    memory_bytes: int
    extra: dict[str, int] = field(default_factory=dict)
