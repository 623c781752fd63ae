"""LMCache's chunks cut into the engine's blocks, so that requests keyed at the engine's
block size find them.

LMCache reports each stored chunk (256 tokens by default) as one `BlockStored` whose
`block_size` is the chunk's token count, with one hash, LMCache's chunk hash
(docs/kv-events.md, "LMCache"). The index keys a stored event's blocks in the
namespace of the event's `block_size`, so a 256-token chunk is one block of the 256
namespace, and a request keyed at the engine's 16 never meets it. `ChunkSplitter` sits
between the engines' batches and the index (after the group folder) and rewrites such a
chunk as the engine blocks it covers:

* a chunk whose `block_size` is k times the engine's block size becomes k blocks of the
  engine's size, each under a hash derived from the chunk's hash and its position
  (`sub_hash`); the first one's parent is the last block of the parent chunk;
* a chunk shorter than the source's chunks (LMCache in the vLLM process reports a
  prompt's short last chunk) keeps its whole blocks only; nothing chains after it, so
  the tokens past its last whole block are dropped, as an engine caches whole blocks
  only;
* a chunk chained after a chunk that was not a whole number of blocks would put every
  token off the engine's block boundaries (a chunk size that is not a multiple of the
  block size): it is passed as it came (it matches nothing at the engine's size) and
  counted (`SplitStats.misaligned_chunks`);
* a removal of a chunk hash removes the blocks it was cut into.

Events at the engine's block size (the GPU's, a native CPU offload's) pass untouched,
and a batch with none of the above is returned as the same bytes after a byte scan,
without decoding. The splitter only needs the engine's block size, which the gateway
knows (`block_size` in its config, checked against each engine at start-up).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgpack

from quillcache._native import EventDecodeError, decode_batch
from quillcache.events.encode import encode_batch
from quillcache.events.types import BlockRemoved, BlockStored, Event, normalize_medium

log = logging.getLogger(__name__)

_BLOCK_SIZE_KEY = b"\xaablock_size"
_REMOVED = b"BlockRemoved"
_CLEARED = b"AllBlocksCleared"
_MASK = (1 << 64) - 1


def sub_hash(chunk_hash: int, i: int) -> int:
    """The hash of engine block `i` of a chunk: 64 bits of BLAKE2b over the chunk's hash
    and `i` (no engine hash is derived this way; a collision is as unlikely as between
    two engines' own 64-bit hashes)."""
    digest = hashlib.blake2b(struct.pack("<QI", chunk_hash & _MASK, i), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


@dataclass
class SplitStats:
    """Counters of the splitter (cumulative)."""

    split_chunks: int = 0  # chunks cut into engine blocks
    split_blocks: int = 0  # engine blocks they became
    dropped_tokens: int = 0  # tokens of short last chunks past their last whole block
    misaligned_chunks: int = 0  # chunks passed as they came: not on the block boundaries


@dataclass
class _Source:
    #: engine blocks per chunk, from the source's full chunks
    chunk_blocks: int = 0
    #: medium -> chunk hash -> the engine blocks it was cut into
    chunks: dict[str, dict[int, int]] = field(default_factory=dict)
    #: medium -> chunks that were not a whole number of engine blocks
    short: dict[str, set[int]] = field(default_factory=dict)


class ChunkSplitter:
    """Per source, the chunks it stored and what they became.

    Not thread-safe: the sinks call it from the ingestor's one applier thread."""

    def __init__(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self._size_bytes = _BLOCK_SIZE_KEY + msgpack.packb(block_size)
        self._sources: dict[tuple[int, int], _Source] = {}
        self._workers: dict[int, int] = {}  # worker -> its sources here
        #: worker -> the media its chunks came on, as msgpack strings (the byte scan)
        self._media: dict[int, set[bytes]] = {}
        self.stats = SplitStats()

    def _may_split(self, worker: int, dp_rank: int, payload: bytes) -> bool:
        """False when the batch certainly has no event to rewrite (a byte scan)."""
        sized = payload.count(_BLOCK_SIZE_KEY)
        if sized != payload.count(self._size_bytes):
            return True  # a stored event at another block size (or array form below)
        media = self._media.get(worker)
        if media:  # removals of its chunks, stores chained after them, clears
            return _CLEARED in payload or any(m in payload for m in media)
        return False

    def split(self, worker: int, payload: bytes, dp_rank: int = 0) -> bytes:
        """The batch the index should apply for `payload`: `payload` itself (the same
        object) unless it stores or removes chunks larger than the engine's blocks. A
        payload that does not decode is returned as it is, for the index to reject."""
        if not self._may_split(worker, dp_rank, payload):
            return payload
        try:
            batch = decode_batch(payload if type(payload) is bytes else bytes(payload))
        except EventDecodeError:
            return payload
        rank = dp_rank if batch.dp_rank is None else batch.dp_rank
        src = self._sources.get((worker, rank))
        out: list[Event] = []
        changed = False
        for ev in batch.events:
            if src is None and isinstance(ev, BlockStored) and self._is_chunk(ev, None):
                src = self._sources[(worker, rank)] = _Source()
                self._workers[worker] = self._workers.get(worker, 0) + 1
            rewritten = None if src is None else self._rewrite(worker, src, ev)
            if rewritten is None:
                out.append(ev)
            else:
                out.extend(rewritten)
                changed = True
        if not changed:
            return payload
        return encode_batch(out, ts=batch.ts, dp_rank=batch.dp_rank)

    def _rewrite(self, worker: int, src: _Source, ev: Event) -> list[Event] | None:
        """What `ev` becomes for a source that has chunks (None: `ev` as it came)."""
        if isinstance(ev, BlockStored):
            if self._is_chunk(ev, src):
                self._media.setdefault(worker, set()).add(_packed(ev.medium))
                return self._store(src, ev)
            chained = self._chained(src, ev)
            return None if chained is None else [chained]
        if isinstance(ev, BlockRemoved):
            removed = self._remove(src, ev)
            return None if removed is None else [removed]
        src.chunks.clear()  # AllBlocksCleared: the engine's tiers are empty
        src.short.clear()
        return None

    def clear(self, worker: int, dp_rank: int = 0) -> None:
        """Forget a source (restart, unrecoverable gap, removed)."""
        if self._sources.pop((worker, dp_rank), None) is not None:
            left = self._workers[worker] - 1
            if left:
                self._workers[worker] = left
            else:
                del self._workers[worker]
                self._media.pop(worker, None)

    def _is_chunk(self, ev: BlockStored, src: _Source | None) -> bool:
        """One chunk: one hash over `block_size` tokens, at another size than the
        engine's, or at its size but chained after a chunk cut here (a short last
        chunk of exactly one block)."""
        if len(ev.block_hashes) != 1 or len(ev.token_ids) != ev.block_size:
            return False
        if ev.block_size != self.block_size:
            return True
        return src is not None and self._parent_is_chunk(src, ev)

    def _parent_is_chunk(self, src: _Source, ev: BlockStored) -> bool:
        parent = ev.parent_block_hash
        chunks = src.chunks.get(normalize_medium(ev.medium))
        return parent is not None and chunks is not None and int(parent) in chunks

    def _chained(self, src: _Source, ev: BlockStored) -> BlockStored | None:
        """Engine blocks stored after a chunk cut here name its last block as parent."""
        if not self._parent_is_chunk(src, ev):
            return None
        assert ev.parent_block_hash is not None
        parent = int(ev.parent_block_hash)
        n = src.chunks[normalize_medium(ev.medium)][parent]
        return dataclasses.replace(ev, parent_block_hash=sub_hash(parent, max(n, 1) - 1))

    def _store(self, src: _Source, ev: BlockStored) -> list[Event] | None:
        """The engine-block events of a chunk, or None to pass it as it came."""
        bs, size = ev.block_size, self.block_size
        medium = normalize_medium(ev.medium)
        chunks = src.chunks.setdefault(medium, {})
        shorts = src.short.setdefault(medium, set())
        parent = None if ev.parent_block_hash is None else int(ev.parent_block_hash)
        if parent is not None and parent in shorts:
            # after a chunk that was not a whole number of blocks, every token is off
            # the engine's block boundaries (a chunk size that is not a multiple of it)
            self._misaligned(bs)
            return None
        n = bs // size
        if bs % size == 0:
            src.chunk_blocks = max(src.chunk_blocks, n)
        else:  # a short last chunk (or the first of misaligned ones: see above)
            shorts.add(int(ev.block_hashes[0]))
            self.stats.dropped_tokens += bs - n * size
        chunk = int(ev.block_hashes[0])
        chunks[chunk] = n
        self.stats.split_chunks += 1
        self.stats.split_blocks += n
        if n == 0:
            return []
        if parent is not None:
            # a parent this splitter did not see (a restart in between; LMCache's 0
            # after a skipped prefix) is named as a full chunk's last block would be
            parent = sub_hash(parent, (chunks.get(parent) or src.chunk_blocks or n) - 1)
        return [
            dataclasses.replace(
                ev,
                block_hashes=[sub_hash(chunk, i) for i in range(n)],
                parent_block_hash=parent,
                token_ids=list(ev.token_ids[: n * size]),
                block_size=size,
                extra_keys=None,
            )
        ]

    def _misaligned(self, bs: int) -> None:
        self.stats.misaligned_chunks += 1
        if self.stats.misaligned_chunks == 1:
            log.warning(
                "stored chunks of %d tokens are not on the engine's %d-token block "
                "boundaries: chunks like them are indexed as they came (not matched)",
                bs,
                self.block_size,
            )

    def _remove(self, src: _Source, ev: BlockRemoved) -> BlockRemoved | None:
        chunks = src.chunks.get(normalize_medium(ev.medium))
        if not chunks:
            return None
        hashes: list[int] = []
        hit = False
        for h in ev.block_hashes:
            n = chunks.pop(int(h), None)
            src.short.get(normalize_medium(ev.medium), set()).discard(int(h))
            if n is None:
                hashes.append(int(h))
            else:
                hit = True
                hashes.extend(sub_hash(int(h), i) for i in range(n))
        if not hit:
            return None
        return BlockRemoved(block_hashes=hashes, medium=ev.medium, group_idx=ev.group_idx)


def _packed(medium: str | None) -> bytes:
    return bytes(msgpack.packb(medium))


def split_payloads(
    splitter: ChunkSplitter | None, worker: int, payloads: Sequence[bytes], dp_rank: int = 0
) -> list[bytes]:
    """`split` over a call's payloads, one for one (all of them as they came without a
    splitter)."""
    if splitter is None:
        return list(payloads)
    return [splitter.split(worker, p, dp_rank) for p in payloads]
