"""Plain value types shared by every index backend."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


@dataclass(frozen=True)
class IndexStats:
    blocks: int  # distinct content keys in the index (including pinned-only ones)
    resident_pairs: int  # (block, source, medium) triples
    sources: int
    memory_bytes: int
    extra: dict[str, int] = field(default_factory=dict)
