"""`MemoryIndex`: the pure-Python reference index, simple enough to be obviously right.

Plain dicts, the pure-Python decoder (`quillcache.events.pyref`) and the
pure-Python content key (`quillcache.hashing.reference`): an oracle that shares no
code with the Rust index it is compared against but one rule, how a BlockStored's
LoRA, tenant and multimodal items are read from the event, which is written once in
Rust (`quillcache._native.stored_identity`). Every rule is in `docs/index.md`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from quillcache._native import stored_identity
from quillcache.errors import EventDecodeError
from quillcache.events.pyref import decode_batch
from quillcache.events.types import (
    MAX_CUSTOM_MEDIA,
    MAX_MEDIUM_NAME_BYTES,
    OTHER_MEDIUM,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    is_known_medium,
    normalize_medium,
)
from quillcache.hashing.reference import block_key, namespace_id
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

#: (source, medium): one holder of a block.
Holder = tuple[SourceId, str]


@dataclass
class _Node:
    key: int
    parent: int  # parent key; the namespace id at depth 0; 0 if unknown (pinned root)
    depth: int
    parent_node: int | None  # key of the parent node, None for a root
    holders: dict[Holder, int] = field(default_factory=dict)  # -> refcount
    pins: int = 0
    children: set[int] = field(default_factory=set)


@dataclass
class _Source:
    model: str = ""
    tokenizer: str = ""
    engine: dict[tuple[int, EngineHash], int] = field(default_factory=dict)  # (group, hash) -> key


class MemoryIndex:
    """The reference implementation of `IndexBackend` (see `docs/index.md`)."""

    name = "memory"
    thread_safe = False

    @classmethod
    def unavailable(cls) -> str | None:
        return None  # built in: always usable

    def __init__(self) -> None:
        self._nodes: dict[int, _Node] = {}
        self._sources: dict[SourceId, _Source] = {}
        self._custom_media: set[str] = set()  # unknown medium names kept so far
        self._media_folded = 0

    # --- sources ---------------------------------------------------------------

    def register_source(
        self, worker: int, dp_rank: int = 0, *, model: str = "", tokenizer: str = ""
    ) -> None:
        check_source(worker, dp_rank)
        src = self._sources.setdefault(SourceId(worker, dp_rank), _Source())
        src.model, src.tokenizer = model, tokenizer

    def remove_worker(self, worker: int) -> int:
        dropped = 0
        for sid in [s for s in self._sources if s.worker == worker]:
            dropped += self._clear(sid)
            del self._sources[sid]
        return dropped

    def clear_source(self, worker: int, dp_rank: int = 0) -> int:
        sid = SourceId(worker, dp_rank)
        return self._clear(sid) if sid in self._sources else 0

    def clear_medium(self, worker: int, dp_rank: int, medium: str) -> int:
        check_source(worker, dp_rank)
        sid = SourceId(worker, dp_rank)
        src = self._sources.get(sid)
        if src is None:
            return 0
        holder = (sid, self._medium(normalize_medium(check_medium(medium)), storing=False))
        dropped = 0
        let_go: set[int] = set()
        emptied = []
        for node in self._nodes.values():
            if node.holders.pop(holder, None) is None:
                continue
            dropped += 1
            if not any(s == sid for s, _ in node.holders):
                let_go.add(node.key)
            if not node.holders:
                emptied.append(node.key)
        for hk in [hk for hk, key in src.engine.items() if key in let_go]:
            del src.engine[hk]
        for key in emptied:
            self._collect(key)
        return dropped

    def _clear(self, sid: SourceId) -> int:
        self._sources[sid].engine.clear()
        dropped = 0
        emptied = []
        for node in self._nodes.values():
            for holder in [h for h in node.holders if h[0] == sid]:
                del node.holders[holder]
                dropped += 1
            if not node.holders:
                emptied.append(node.key)
        for key in emptied:
            self._collect(key)
        return dropped

    # --- events ----------------------------------------------------------------

    def apply(
        self,
        worker: int,
        payloads: Sequence[bytes],
        dp_rank: int = 0,
        *,
        seqs: Sequence[int] | None = None,  # an in-memory index outlives no restart
    ) -> ApplyStats:
        check_source(worker, dp_rank)
        if any(not isinstance(p, (bytes, bytearray, memoryview)) for p in payloads):
            raise InvalidIndexInputError("payloads must be bytes-like (raw msgpack batches)")
        total = ApplyStats()
        for i, payload in enumerate(payloads):
            try:
                batch = decode_batch(payload)
                rank = dp_rank if batch.dp_rank is None else batch.dp_rank
                if not 0 <= rank < 1 << 32:
                    raise ValueError(f"batch dp_rank {rank} is not a valid rank")
            except (EventDecodeError, ValueError) as exc:
                where = f"payload {i} of {len(payloads)} from worker {worker}"
                err = EventDecodeError(f"{where}: {exc}")
                err.payload_index = i
                err.stats = total
                raise err from None
            sid = SourceId(worker, rank)
            src = self._sources.setdefault(sid, _Source())
            total.batches += 1
            total.events += len(batch.events)
            for ev in batch.events:
                if isinstance(ev, BlockStored):
                    self._store(sid, src, ev, total)
                elif isinstance(ev, BlockRemoved):
                    self._remove(sid, src, ev, total)
                elif isinstance(ev, AllBlocksCleared):
                    total.clears += 1
                    self._clear(sid)
        return total

    def _add_holder(self, key: int, holder: Holder) -> None:
        holders = self._nodes[key].holders
        holders[holder] = holders.get(holder, 0) + 1

    def _get_or_create(self, key: int, parent: int, parent_node: int | None, depth: int) -> None:
        if key not in self._nodes:
            self._nodes[key] = _Node(key, parent, depth, parent_node)
            if parent_node is not None:
                self._nodes[parent_node].children.add(key)

    def _medium(self, medium: str, *, storing: bool) -> str:
        """The name holders of `medium` are kept under: its own, or OTHER_MEDIUM when it is
        too long or one unknown name too many (docs/kv-events.md). A store admits a new
        name; a removal only looks."""
        if medium in self._custom_media or is_known_medium(medium):
            return medium
        fits = len(medium.encode("utf-8", "surrogatepass")) <= MAX_MEDIUM_NAME_BYTES
        if fits and len(self._custom_media) < MAX_CUSTOM_MEDIA:
            if storing:
                self._custom_media.add(medium)
            return medium
        if storing:
            self._media_folded += 1
        return OTHER_MEDIUM

    def _store(self, sid: SourceId, src: _Source, ev: BlockStored, stats: ApplyStats) -> None:
        n = len(ev.block_hashes)
        if n == 0:
            return
        holder = (sid, self._medium(normalize_medium(ev.medium), storing=True))
        if not ev.token_ids:
            for h in ev.block_hashes:
                key = src.engine.get((ev.group_idx or 0, h))
                if key is not None and key in self._nodes:
                    self._add_holder(key, holder)
                    stats.blocks_stored += 1
                else:
                    stats.orphan_blocks += 1
            return
        bs = ev.block_size
        if bs == 0 or len(ev.token_ids) < n * bs:
            stats.invalid_events += 1
            return
        lora, tenant, mm = stored_identity(ev.cache_salt, ev.lora_name, ev.extra_keys)
        if ev.parent_block_hash is None:
            parent: int = namespace_id(
                model=src.model,
                tokenizer=src.tokenizer,
                lora=lora,
                tenant=tenant,
                block_size=bs,
            )
            parent_node: int | None = None
            depth = 0
        else:
            pkey = src.engine.get((ev.group_idx or 0, ev.parent_block_hash))
            if pkey is None or pkey not in self._nodes:
                stats.orphan_blocks += n
                return
            parent, parent_node, depth = pkey, pkey, self._nodes[pkey].depth + 1
        for i, h in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            key = block_key(parent, tokens, mm[i] if i < len(mm) else None)
            self._get_or_create(key, parent, parent_node, depth)
            self._add_holder(key, holder)
            src.engine[(ev.group_idx or 0, h)] = key
            stats.blocks_stored += 1
            parent, parent_node, depth = key, key, depth + 1

    def _remove(self, sid: SourceId, src: _Source, ev: BlockRemoved, stats: ApplyStats) -> None:
        holder = (sid, self._medium(normalize_medium(ev.medium), storing=False))
        for h in ev.block_hashes:
            hk = (ev.group_idx or 0, h)
            key = src.engine.get(hk)
            node = self._nodes.get(key) if key is not None else None
            if key is None:
                stats.unknown_removals += 1
                continue
            if node is None:
                stats.unknown_removals += 1
                del src.engine[hk]
                continue
            if holder in node.holders:
                stats.blocks_removed += 1
                node.holders[holder] -= 1
                if node.holders[holder] == 0:
                    del node.holders[holder]
            else:
                stats.unknown_removals += 1
            if not any(s == sid for s, _ in node.holders):
                del src.engine[hk]
            self._collect(key)

    def _collect(self, key: int | None) -> None:
        """Drop `key` and then its ancestors while they have no holder, pin or child."""
        while key is not None and key in self._nodes:
            node = self._nodes[key]
            if node.holders or node.pins or node.children:
                return
            del self._nodes[key]
            if node.parent_node is not None:
                self._nodes[node.parent_node].children.discard(key)
            key = node.parent_node

    # --- queries ---------------------------------------------------------------

    def match_columns(self, keys: KeyArray) -> MatchColumns:
        return MatchColumns.of(self.match(keys))

    def match_tiers(
        self,
        keys: KeyArray,
        position: npt.NDArray[np.intp],
        candidates: int,
        rank_counts: npt.NDArray[np.intp] | None = None,
        *,
        all_live: bool = False,  # a full match has no floors to place
    ) -> tuple[npt.NDArray[np.int64], MatchColumns]:
        cols = self.match_columns(keys)
        return cols.tiers(position, candidates, rank_counts), cols

    def match(self, keys: KeyArray) -> list[Match]:
        keys_list = [int(k) for k in as_key_array(keys)]
        lengths: dict[Holder, int] = {}
        alive: set[Holder] | None = None
        for i, key in enumerate(keys_list):
            node = self._nodes.get(key)
            held = set(node.holders) if node else set()
            alive = held if alive is None else alive & held
            if not alive:
                break
            for holder in alive:
                lengths[holder] = i + 1
        return sorted(Match(s.worker, s.dp_rank, m, n) for (s, m), n in lengths.items())

    def _entry(self, node: _Node) -> Entry:
        holders = tuple(
            sorted(
                (Residency(s.worker, s.dp_rank, m, rc) for (s, m), rc in node.holders.items()),
                key=lambda r: (r.worker, r.dp_rank, r.medium),
            )
        )
        return Entry(node.key, node.parent, node.depth, holders, node.pins > 0)

    def scan(self, prefix: KeyArray) -> list[Entry]:
        prefix_keys = [int(k) for k in as_key_array(prefix)]
        if not prefix_keys:
            nodes = list(self._nodes.values())
        elif prefix_keys[-1] not in self._nodes:
            nodes = []
        else:
            nodes, stack = [], [prefix_keys[-1]]
            while stack:
                node = self._nodes[stack.pop()]
                nodes.append(node)
                stack.extend(node.children)
        visible = [n for n in nodes if n.holders or n.pins]
        return [self._entry(n) for n in sorted(visible, key=lambda n: n.key)]

    def entries(self) -> Iterator[Entry]:
        for node in list(self._nodes.values()):
            if node.holders or node.pins:
                yield self._entry(node)

    # --- pins ------------------------------------------------------------------

    def pin(self, keys: KeyArray) -> None:
        parent, parent_node = 0, None
        for pos, key in enumerate(int(k) for k in as_key_array(keys)):
            self._get_or_create(key, parent, parent_node, pos)
            self._nodes[key].pins += 1
            parent, parent_node = key, key

    def unpin(self, keys: KeyArray) -> None:
        for key in reversed([int(k) for k in as_key_array(keys)]):
            node = self._nodes.get(key)
            if node is not None and node.pins > 0:
                node.pins -= 1
                self._collect(key)

    # --- accounting ------------------------------------------------------------

    def last_seqs(self) -> dict[SourceId, int]:
        return {}  # in memory only: nothing to resume from after a restart

    def stats(self) -> IndexStats:
        visible = [n for n in self._nodes.values() if n.holders or n.pins]
        return IndexStats(
            blocks=len(visible),
            resident_pairs=sum(len(n.holders) for n in self._nodes.values()),
            sources=len(self._sources),
            memory_bytes=self._memory_bytes(),
            extra={
                "nodes": len(self._nodes),
                "pinned": sum(1 for n in visible if n.pins),
                "media_folded": self._media_folded,
            },
        )

    def _memory_bytes(self) -> int:
        """Shallow sizes of every container and node (keys shared across dicts counted once)."""
        size = sys.getsizeof(self._nodes) + sys.getsizeof(self._sources)
        for node in self._nodes.values():
            size += sys.getsizeof(node) + sys.getsizeof(node.__dict__)
            size += sys.getsizeof(node.key) + sys.getsizeof(node.parent)
            size += sys.getsizeof(node.holders) + sys.getsizeof(node.children)
            size += sum(sys.getsizeof(h) for h in node.holders)
        # Medium names once each (every holder of a name shares it).
        names = {h[1] for node in self._nodes.values() for h in node.holders}
        size += sum(sys.getsizeof(m) for m in names | self._custom_media)
        for src in self._sources.values():
            size += sys.getsizeof(src) + sys.getsizeof(src.engine)
            size += sum(sys.getsizeof(k) for k in src.engine)
        return size

    def close(self) -> None:
        """Nothing to release."""
