"""KV-cache groups: an engine's per-group events folded into the one residency routing uses.

A hybrid model (full attention plus sliding window, attention plus Mamba state) has
several KV-cache groups, and vLLM publishes each group's stores and evictions with its
`group_idx` (vLLM 0.34, `vllm/v1/core/block_pool.py`). Groups of one block size carry
the same block hashes, so the same hash arrives once per group; a prefix is reusable
by the engine only where every group can serve it (`HybridKVCacheCoordinator.
find_longest_cache_hit` in `vllm/v1/core/kv_cache_coordinator.py`).

`GroupFolder` sits between the engines' raw batches and the index: it turns the
batches of a source that publishes groups into single-group batches in which a block
is stored only while **every group the source has announced** holds it, and removed
as soon as one group lets it go (the rule, and why it is the one chosen, is in
`docs/kv-events.md`, "KV-cache groups"). A source that never names a group other than
0 is passed through untouched: its payload bytes are returned as they came.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack

from quillcache._native import EventDecodeError, decode_batch
from quillcache.events.types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExtraKey,
    MmKey,
    RawKey,
    normalize_medium,
)

log = logging.getLogger(__name__)

#: KV-cache groups one source may have (group ids 0 .. this - 1). vLLM's hybrid models
#: have a few (one per attention type); a batch naming a higher group is refused.
MAX_GROUPS_PER_SOURCE = 32

# A payload names a group only through the key "group_idx" (map events) or as a
# positional field (array events): BlockStored's 9th field, BlockRemoved's 3rd, so in
# an array of at least 10 or 4 elements (a fixarray header right before the type name,
# or an array16 header three bytes before). vLLM >= 0.30 writes the key on every event,
# as the fixstr `a9 "group_idx"` then 0 (`00`) for a single-group model; nil (`c0`) is
# 0 too. The batch's first event tells the form (every engine writes one form); the
# scan is a few C-level passes, and a false positive (those bytes inside a string,
# another encoding of the key) costs one decode, no more.
_GROUP_KEY = b"group_idx"
_GROUP_KEY_ZERO = b"\xa9group_idx\x00"
_GROUP_KEY_NIL = b"\xa9group_idx\xc0"
_POSITIONAL = ((b"\xabBlockStored", 0x9A), (b"\xacBlockRemoved", 0x94))
# Bytes taken by a msgpack number by its first byte (the batch's ts).
_NUMBER_SIZE = {0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9}
_NUMBER_SIZE |= {0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9}


def _first_event_is_array(payload: bytes) -> bool:
    """Whether the batch's first event is a msgpack array (else a map, or no event)."""
    if len(payload) < 2 or payload[0] not in (0x92, 0x93):
        return False
    head = payload[1]
    at = 2 if head < 0x80 or head >= 0xE0 else 1 + _NUMBER_SIZE.get(head, len(payload))
    if at >= len(payload):
        return False
    events = payload[at]
    if 0x91 <= events <= 0x9F:
        at += 1
    elif events == 0xDC:
        at += 3
    elif events == 0xDD:
        at += 5
    else:  # no event, or not an array: the index judges it
        return False
    if at >= len(payload):
        return False
    first = payload[at]
    return 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)


def _positional_group_field(payload: bytes) -> bool:
    for name, min_header in _POSITIONAL:
        at = payload.find(name)
        while at >= 0:
            if at >= 1 and min_header <= payload[at - 1] <= 0x9F:
                return True
            if at >= 3 and payload[at - 3] == 0xDC:
                return True
            at = payload.find(name, at + 1)
    return False


#: (worker, dp_rank) as the batch says (its own rank wins over the caller's).
SourceKey = tuple[int, int]


@dataclass(slots=True)
class _Block:
    """What a BlockStored said about one block: enough to store it again in group 0."""

    parent: int | None
    tokens: Sequence[int]
    block_size: int
    extra_keys: list[Any] | None  # as written on the wire
    lora_id: int | None
    lora_name: str | None
    cache_salt: str | None


@dataclass
class _Source:
    announced: set[int] = field(default_factory=set)
    # (medium, group) -> engine hash -> how many copies that group holds (vLLM does not
    # deduplicate physical copies: a hash can be stored twice and removed once).
    held: dict[tuple[str, int], dict[int, int]] = field(default_factory=dict)
    blocks: dict[int, _Block] = field(default_factory=dict)  # hash -> its content
    children: dict[int, set[int]] = field(default_factory=dict)  # parent hash -> hashes
    folded: dict[str, set[int]] = field(default_factory=dict)  # medium -> stored in group 0
    #: opaque token of the registration this state belongs to (see `GroupFolder.fold`)
    owner: object = None


@dataclass
class FoldStats:
    """Counters of the folder (cumulative)."""

    grouped_sources: int = 0  # sources seen naming a group other than 0
    folded_batches: int = 0  # batches rewritten
    unplaced_blocks: int = 0  # hashes of stores whose tokens do not say which block is which
    refused_batches: int = 0  # batches naming more than MAX_GROUPS_PER_SOURCE groups


def may_name_group(payload: bytes) -> bool:
    """False when the payload certainly names no group but 0 (a byte scan, no decode)."""
    if _first_event_is_array(payload):
        return _positional_group_field(payload)
    n = payload.count(_GROUP_KEY)
    if n == 0:
        return False
    zeros = payload.count(_GROUP_KEY_ZERO)
    return zeros != n and zeros + payload.count(_GROUP_KEY_NIL) != n


def _names_group(batch: EventBatch) -> bool:
    return any(
        isinstance(ev, (BlockStored, BlockRemoved)) and (ev.group_idx or 0) != 0
        for ev in batch.events
    )


_CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def _wire_key(key: ExtraKey) -> Any:
    """An extra-key item as the engine wrote it (the decoder's classes undone)."""
    if isinstance(key, MmKey):
        return [key.hash, key.offset]
    if isinstance(key, RawKey):
        return msgpack.unpackb(key.msgpack)
    return key


def _removed(h: int, medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": [h], "medium": medium, "group_idx": 0}


def _append_stored(out: list[dict[str, Any]], h: int, b: _Block, medium: str) -> None:
    """A group-0 BlockStored of block `h`, appended to the previous event when that one
    ends with `h`'s parent and says the same of its blocks (one event per chain)."""
    last = out[-1] if out else None
    if (
        last is not None
        and last["type"] == "BlockStored"
        and b.parent is not None
        and last["block_hashes"][-1] == b.parent
        and last["medium"] == medium
        and last["block_size"] == b.block_size
        and last["lora_id"] == b.lora_id
        and last["lora_name"] == b.lora_name
        and last["cache_salt"] == b.cache_salt
    ):
        last["block_hashes"].append(h)
        last["token_ids"].extend(b.tokens)
        last["extra_keys"].append(b.extra_keys)
        return
    out.append(
        {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": b.parent,
            "token_ids": list(b.tokens),
            "block_size": b.block_size,
            "lora_id": b.lora_id,
            "medium": medium,
            "lora_name": b.lora_name,
            "extra_keys": [b.extra_keys],
            "group_idx": 0,
            "cache_salt": b.cache_salt,
        }
    )


class GroupFolder:
    """Per source, the residency of every KV-cache group, and the group-0 view of it.

    Not thread-safe: the sinks call it from the ingestor's one applier thread, as they
    apply; a caller with several threads serialises `fold` and `clear`."""

    def __init__(self) -> None:
        self._sources: dict[SourceKey, _Source] = {}
        self._grouped_workers: dict[int, int] = {}  # worker -> grouped ranks
        self.stats = FoldStats()

    def grouped(self, worker: int, dp_rank: int = 0) -> bool:
        """Whether this source's batches are being folded."""
        return (worker, dp_rank) in self._sources

    def fold(self, worker: int, payload: bytes, dp_rank: int = 0, owner: object = None) -> bytes:
        """The batch the index should apply for `payload`: `payload` itself (the same
        object) unless the source publishes groups. `owner` names the registration of
        the worker (e.g. its state object in the control plane): state kept for another
        owner is stale (the worker was removed and added again) and is dropped.

        A payload that does not decode is returned as it is, for the index to reject
        with its own error. A batch that names more than `MAX_GROUPS_PER_SOURCE` groups
        raises `EventDecodeError` naming the limit (nothing of it is applied)."""
        if worker not in self._grouped_workers and not may_name_group(payload):
            return payload
        try:
            batch = decode_batch(payload if type(payload) is bytes else bytes(payload))
        except EventDecodeError:
            return payload
        rank = dp_rank if batch.dp_rank is None else batch.dp_rank
        key = (worker, rank)
        src = self._sources.get(key)
        if src is not None and src.owner is not owner:
            self.clear(worker, rank)
            src = None
        if src is None and not _names_group(batch):
            return payload
        out: list[dict[str, Any]] = []
        if src is None:
            # What the index holds for this source was applied without the other
            # groups' view: start again from nothing (a missed hit, never a false one).
            src = _Source(owner=owner)
            out.append(_CLEARED)
            self._sources[key] = src
            self._grouped_workers[worker] = self._grouped_workers.get(worker, 0) + 1
            self.stats.grouped_sources += 1
            log.info(
                "KV events of worker %d rank %d name KV-cache groups: a block counts for "
                "routing only where every group holds it",
                worker,
                rank,
            )
        # vLLM numbers a model's groups 0 .. n-1 (`kv_cache_groups`): a group named
        # announces every group below it too.
        top = max(
            (ev.group_idx or 0 for ev in batch.events if not isinstance(ev, AllBlocksCleared)),
            default=0,
        )
        if top >= MAX_GROUPS_PER_SOURCE:
            self.stats.refused_batches += 1
            log.warning(
                "KV events of worker %d rank %d name KV-cache group %d, beyond "
                "MAX_GROUPS_PER_SOURCE=%d; batch refused",
                worker,
                rank,
                top,
                MAX_GROUPS_PER_SOURCE,
            )
            raise EventDecodeError(
                f"batch names KV-cache group {top}, beyond MAX_GROUPS_PER_SOURCE="
                f"{MAX_GROUPS_PER_SOURCE}, for worker {worker} rank {rank}"
            )
        announce = set(range(top + 1)) - src.announced
        for group in sorted(announce):
            self._announce(src, group, out)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._store(src, ev, out)
            elif isinstance(ev, BlockRemoved):
                self._remove(src, ev, out)
            else:
                self._clear_blocks(src)
                out.append(_CLEARED)
        self.stats.folded_batches += 1
        wire = [batch.ts, out] if batch.dp_rank is None else [batch.ts, out, batch.dp_rank]
        return bytes(msgpack.packb(wire, use_bin_type=True))

    def clear(self, worker: int, dp_rank: int = 0) -> None:
        """Forget a source (the engine restarted, or its residency was dropped): its
        groups are announced again by its next events."""
        if self._sources.pop((worker, dp_rank), None) is not None:
            left = self._grouped_workers[worker] - 1
            if left:
                self._grouped_workers[worker] = left
            else:
                del self._grouped_workers[worker]

    def forget_worker(self, worker: int) -> None:
        """Forget every rank of a worker."""
        for key in [k for k in self._sources if k[0] == worker]:
            self.clear(*key)

    # --- folding -------------------------------------------------------------------

    def _announce(self, src: _Source, group: int, out: list[dict[str, Any]]) -> None:
        """A new group: what it does not hold is no longer usable."""
        src.announced.add(group)
        for medium, folded in src.folded.items():
            held = src.held.get((medium, group), {})
            for h in [h for h in folded if h not in held]:
                folded.discard(h)
                out.append(_removed(h, medium))

    def _store(self, src: _Source, ev: BlockStored, out: list[dict[str, Any]]) -> None:
        medium = normalize_medium(ev.medium)
        group = ev.group_idx or 0
        hashes = [int(h) for h in ev.block_hashes]
        bs = ev.block_size
        tokens = ev.token_ids
        if tokens:
            if bs <= 0 or len(tokens) != len(hashes) * bs:
                # vLLM skips masked and null blocks of a sparse group (sliding window,
                # Mamba) but sends the tokens of the whole range: which hash is which
                # block is not said, so none of them is placed (docs/kv-events.md).
                self.stats.unplaced_blocks += len(hashes)
                return
            extra = ev.extra_keys or ()
            parent = None if ev.parent_block_hash is None else int(ev.parent_block_hash)
            blocks, children = src.blocks, src.children
            for i, h in enumerate(hashes):
                if h not in blocks:
                    keys = extra[i] if i < len(extra) else None
                    blocks[h] = _Block(
                        parent,
                        tokens[i * bs : (i + 1) * bs],
                        bs,
                        None if keys is None else [_wire_key(k) for k in keys],
                        ev.lora_id,
                        ev.lora_name,
                        ev.cache_salt,
                    )
                    if parent is not None:
                        children.setdefault(parent, set()).add(h)
                parent = h
        held = src.held.setdefault((medium, group), {})
        known = [h for h in hashes if h in src.blocks]  # token-less: blocks described before
        for h in known:
            held[h] = held.get(h, 0) + 1
        self._fold_from(src, medium, known, out)

    def _fold_from(
        self, src: _Source, medium: str, hashes: list[int], out: list[dict[str, Any]]
    ) -> None:
        """Store in group 0 each of `hashes` that every group holds and whose parent is
        stored there, and the children this makes storable, depth first."""
        folded = src.folded.setdefault(medium, set())
        helds = [src.held.get((medium, g), {}) for g in src.announced]
        blocks, children = src.blocks, src.children
        stack = hashes[::-1]  # in chain order, so that one event takes a whole chain
        while stack:
            x = stack.pop()
            if x in folded:
                continue
            usable = True
            for held in helds:
                if x not in held:
                    usable = False
                    break
            if not usable:
                continue
            b = blocks[x]
            if b.parent is not None and b.parent not in folded:
                continue
            folded.add(x)
            _append_stored(out, x, b, medium)
            kids = children.get(x)
            if kids:
                stack.extend(kids)

    def _remove(self, src: _Source, ev: BlockRemoved, out: list[dict[str, Any]]) -> None:
        medium = normalize_medium(ev.medium)
        held = src.held.get((medium, ev.group_idx or 0))
        if held is None:
            return
        for h in (int(x) for x in ev.block_hashes):
            n = held.get(h, 0)
            if n == 0:
                continue
            if n > 1:
                held[h] = n - 1
                continue
            del held[h]
            folded = src.folded.get(medium)
            if folded is not None and h in folded:
                folded.discard(h)
                out.append(_removed(h, medium))
            self._drop_unheld(src, h)

    def _drop_unheld(self, src: _Source, h: int) -> None:
        """Forget a block's content once no group on any medium holds it."""
        if any(h in held for held in src.held.values()):
            return
        b = src.blocks.pop(h, None)
        if b is not None and b.parent is not None:
            siblings = src.children.get(b.parent)
            if siblings is not None:
                siblings.discard(h)
                if not siblings:
                    del src.children[b.parent]

    def _clear_blocks(self, src: _Source) -> None:
        """AllBlocksCleared: every group is empty; the groups stay announced (a cache
        reset does not change the engine's KV-cache layout)."""
        src.held.clear()
        src.blocks.clear()
        src.children.clear()
        src.folded.clear()


def fold_payloads(
    folder: GroupFolder,
    worker: int,
    payloads: Sequence[bytes],
    dp_rank: int = 0,
    owner: object = None,
) -> tuple[list[bytes], EventDecodeError | None]:
    """`fold` over a call's payloads, one for one; stops at a refused batch and returns
    the payloads before it with the error (its `payload_index` set)."""
    out: list[bytes] = []
    for i, p in enumerate(payloads):
        try:
            out.append(folder.fold(worker, p, dp_rank, owner))
        except EventDecodeError as err:
            err.payload_index = i
            return out, err
    return out, None
