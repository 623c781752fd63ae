"""Simulated requests: their content keys and, on demand, their token ids.

Workloads built from token ids keep them. Traces that only carry block ids (Mooncake)
get deterministic synthetic tokens: block `b`'s `block_size` tokens are a fixed
function of its id (`synthetic_block_tokens`), so real content keys and real
BlockStored token_ids flow through the real event path. Two blocks with the same id
get the same tokens; the content key still chains from the whole prefix, so for
per-block (non-chained) ids equal blocks under different prefixes stay different.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from quillcache.identity import content_keys

U64 = np.uint64
_MASK = (1 << 64) - 1
# Synthetic token ids lie in [256, 65536): a plausible vocabulary range whose msgpack
# encoding has one width (uint16), which lets the simulator encode events fast.
TOKEN_LO, TOKEN_HI = 256, 65536


_TABLE_BITS = 22
_TABLE_LEN = 1 << _TABLE_BITS
_table_cache: dict[int, tuple[npt.NDArray[np.uint32], bytes, bytes]] = {}
# block size -> (every block_size window of the table, of its msgpack encoding): views,
# so a block's tokens are one row and a gather copies whole rows.
_window_cache: dict[int, tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint8]]] = {}


def _table(block_size: int) -> tuple[npt.NDArray[np.uint32], bytes, bytes]:
    """A fixed pseudo-random token table (seeded, so every run sees the same tokens),
    its msgpack encoding (uint16: 0xcd + 2 bytes big-endian per token) and its
    little-endian u32 bytes (what the content key hashes)."""
    cached = _table_cache.get(block_size)
    if cached is None:
        rng = np.random.default_rng(0x71756C6C)
        table = rng.integers(TOKEN_LO, TOKEN_HI, size=_TABLE_LEN + block_size, dtype=np.uint32)
        enc = np.empty((len(table), 3), dtype=np.uint8)
        enc[:, 0] = 0xCD
        enc[:, 1:] = table.astype(">u2").view(np.uint8).reshape(-1, 2)
        cached = (table, enc.tobytes(), table.astype("<u4").tobytes())
        _table_cache[block_size] = cached
    return cached


def _offset(block_id: int) -> int:
    x = (block_id + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) & (_TABLE_LEN - 1)


def _offsets(block_ids: npt.NDArray[np.uint64]) -> npt.NDArray[np.intp]:
    """`_offset` of many ids at once (uint64 arithmetic wraps like the `& _MASK`)."""
    x = block_ids + U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> U64(30))) * U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> U64(27))) * U64(0x94D049BB133111EB)
    return ((x ^ (x >> U64(31))) & U64(_TABLE_LEN - 1)).astype(np.intp)


def _id_tokens(block_id: int) -> tuple[int, int]:
    """The first two tokens spell the id itself, so distinct ids never share tokens."""
    span = TOKEN_HI - TOKEN_LO
    return TOKEN_LO + block_id % span, TOKEN_LO + (block_id // span) % span


def _as_ids(block_ids: Sequence[int] | npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    return np.asarray(block_ids, dtype=U64).reshape(-1)


def _windows(block_size: int) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint8]]:
    cached = _window_cache.get(block_size)
    if cached is None:
        table, enc, _ = _table(block_size)
        enc8 = np.frombuffer(enc, dtype=np.uint8)
        cached = (
            sliding_window_view(table, block_size),
            sliding_window_view(enc8, 3 * block_size)[::3],
        )
        _window_cache[block_size] = cached
    return cached


def _synthetic_matrix(ids: npt.NDArray[np.uint64], block_size: int) -> npt.NDArray[np.uint32]:
    """(blocks, block_size) synthetic tokens of `ids`, gathered from the table."""
    out = _windows(block_size)[0][_offsets(ids)]
    span = U64(TOKEN_HI - TOKEN_LO)
    out[:, 0] = TOKEN_LO + ids % span
    if block_size >= 2:
        out[:, 1] = TOKEN_LO + (ids // span) % span
    return out


def synthetic_block_tokens(block_ids: Sequence[int], block_size: int) -> npt.NDArray[np.uint32]:
    """Tokens of blocks named by trace ids: a window of a fixed random table chosen by
    a hash of the id, its first two tokens replaced by the id (ids < 2**32 distinct)."""
    return _synthetic_matrix(_as_ids(block_ids), block_size).reshape(-1)


def synthetic_layout(
    block_ids: Sequence[int] | npt.NDArray[np.uint64], block_size: int
) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.uint8]]:
    """Per block: its row of the pre-encoded table and its id tokens' msgpack payload
    bytes ((blocks, min(2, block_size), 2) big-endian); what `packed_rows` needs."""
    ids = _as_ids(block_ids)
    span = U64(TOKEN_HI - TOKEN_LO)
    heads = [TOKEN_LO + ids % span, TOKEN_LO + (ids // span) % span][: min(2, block_size)]
    be = np.stack(heads, axis=1).astype(">u2").view(np.uint8).reshape(len(ids), len(heads), 2)
    return _offsets(ids), be


def packed_rows(rows: npt.NDArray[np.intp], heads: npt.NDArray[np.uint8], block_size: int) -> bytes:
    """msgpack array of the tokens of the blocks laid out by `synthetic_layout`: one
    gather of whole pre-encoded rows, then the id tokens patched in."""
    n = len(rows)
    out = _windows(block_size)[1][rows].reshape(n, block_size, 3)
    out[:, : heads.shape[1], 1:] = heads
    return _array_header(n * block_size) + out.tobytes()


def packed_synthetic_tokens(block_ids: Sequence[int], block_size: int) -> bytes:
    """msgpack array of `synthetic_block_tokens(block_ids, block_size)`, gathered from
    the pre-encoded table in one numpy operation (the simulator's hot path)."""
    return packed_rows(*synthetic_layout(block_ids, block_size), block_size)


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


@dataclass(slots=True)
class SimRequest:
    """One request of a workload. Exactly one of `tokens` / `block_ids` is set."""

    rid: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    keys: npt.NDArray[np.uint64]  # content keys of the full blocks
    block_size: int
    session_id: str | None = None
    tokens: npt.NDArray[np.uint32] | None = None
    block_ids: Sequence[int] | None = None
    keys_list: list[int] = field(default_factory=list)  # keys as Python ints (engine side)
    # `synthetic_layout(block_ids)`, computed once (for a whole trace at load)
    layout: tuple[npt.NDArray[np.intp], npt.NDArray[np.uint8]] | None = None
    # closed loop (`quillcache.sim.release`): the requests (rids) whose completion this
    # one waits for, and the think / tool time after the last of them; `arrival_s` is
    # then the open-loop time, used only when the workload is replayed open loop
    parents: tuple[int, ...] = ()
    wait_s: float = 0.0

    @property
    def full_blocks(self) -> int:
        return len(self.keys)

    @property
    def prompt_blocks(self) -> int:
        """Blocks including a trailing partial one (the trace convention for hit rates)."""
        return -(-self.prompt_tokens // self.block_size)

    def block_tokens(self, start: int, end: int) -> npt.NDArray[np.uint32]:
        """Token ids of full blocks [start, end)."""
        bs = self.block_size
        if self.tokens is not None:
            return self.tokens[start * bs : end * bs]
        assert self.block_ids is not None
        return synthetic_block_tokens(self.block_ids[start:end], bs)

    def packed_block_tokens(self, start: int, end: int) -> bytes:
        """msgpack array of `block_tokens(start, end)` (what BlockStored carries)."""
        if self.tokens is not None:
            from quillcache.sim.wire import pack_tokens

            return pack_tokens(self.block_tokens(start, end))
        assert self.block_ids is not None
        if self.layout is None:
            self.layout = synthetic_layout(self.block_ids, self.block_size)
        rows, heads = self.layout
        return packed_rows(rows[start:end], heads[start:end], self.block_size)


def attach_layouts(reqs: Sequence[SimRequest], block_size: int) -> None:
    """Compute every block-id request's `layout` in one vectorised pass (trace load), so
    forked simulation processes share them."""
    todo = [r for r in reqs if r.block_ids is not None and r.layout is None]
    if not todo:
        return
    lengths = [len(r.block_ids or ()) for r in todo]
    rows, heads = synthetic_layout(
        np.fromiter(itertools.chain.from_iterable(r.block_ids or () for r in todo), dtype=U64),
        block_size,
    )
    end = 0
    for r, n in zip(todo, lengths, strict=True):
        start, end = end, end + n
        r.layout = (rows[start:end], heads[start:end])


class KeyChainer:
    """Content keys for block-id sequences, memoised on (parent key, block id); with
    `chained=True` (equal id => equal prefix, checked by the trace loader) on the id."""

    def __init__(self, namespace: int, block_size: int, *, chained: bool = False) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.chained = chained
        self._memo: dict[tuple[int, int], int] = {}
        self._by_id: dict[int, int] = {}  # chained: id -> key

    def keys_for_ids(self, ids: Sequence[int], full_blocks: int) -> list[int]:
        """Keys of the first `full_blocks` blocks of `ids`: memoised prefix, then the
        new tail's synthetic tokens hashed in one native call."""
        if self.chained:
            out = self._known_chained_prefix(ids, full_blocks)
        else:
            memo = self._memo
            parent = self.namespace
            out = []
            for i in range(full_blocks):
                k = memo.get((parent, ids[i]))
                if k is None:
                    break
                out.append(k)
                parent = k
        parent = out[-1] if out else self.namespace
        tail = ids[len(out) : full_blocks]
        if len(tail):
            tokens = _synthetic_matrix(_as_ids(tail), self.block_size).reshape(-1)
            new = content_keys(tokens, self.block_size, parent).tolist()
            if self.chained:
                self._by_id.update(zip(tail, new, strict=True))
            else:
                parents = [parent, *new[:-1]]
                self._memo.update(zip(zip(parents, tail, strict=True), new, strict=True))
            out += new
        return out

    def _known_chained_prefix(self, ids: Sequence[int], full_blocks: int) -> list[int]:
        # In a chained trace an id names its whole prefix, so the ids with a key form a
        # prefix of `ids`: find its end by bisection, then read the keys.
        by_id = self._by_id
        lo, hi = 0, full_blocks  # ids[:lo] known; ids[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ids[mid - 1] in by_id:
                lo = mid
            else:
                hi = mid - 1
        return [by_id[i] for i in ids[:lo]]


def make_request(
    rid: int,
    arrival_s: float,
    output_tokens: int,
    block_size: int,
    namespace: int,
    *,
    tokens: npt.NDArray[np.uint32] | None = None,
    block_ids: Sequence[int] | None = None,
    prompt_tokens: int | None = None,
    chainer: KeyChainer | None = None,
    session_id: str | None = None,
    parents: tuple[int, ...] = (),
    wait_s: float = 0.0,
) -> SimRequest:
    """Build a request from token ids, or from block ids (+ prompt length) and a chainer."""
    if tokens is not None:
        toks = np.asarray(tokens, dtype=np.uint32)
        keys = content_keys(toks, block_size, namespace).tolist()
        n_prompt = len(toks)
    else:
        assert block_ids is not None and prompt_tokens is not None and chainer is not None
        n_prompt = prompt_tokens
        # a trace need not name a trailing partial block: key the full blocks it names
        keys = chainer.keys_for_ids(block_ids, min(prompt_tokens // block_size, len(block_ids)))
        toks = None
    return SimRequest(
        rid=rid,
        arrival_s=arrival_s,
        prompt_tokens=n_prompt,
        output_tokens=output_tokens,
        keys=np.array(keys, dtype=U64),
        block_size=block_size,
        session_id=session_id,
        tokens=toks,
        block_ids=block_ids,
        keys_list=keys,
        parents=parents,
        wait_s=wait_s,
    )
