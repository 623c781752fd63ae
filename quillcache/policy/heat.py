"""Prefix heat: how many requests a second start with each prefix, in bounded memory.

A prefix is named by its last chained content key (the key of block `d - 1` names the
whole prefix of `d` blocks, since each key hashes its parent's). Tracking every depth
of every request would cost one entry per block, so a request is counted at its
*anchors*: the depths 1, 2, 4, 8, ... (powers of two) up to its full-block count. A
prefix of `L` blocks that many requests share is then seen at the deepest anchor
`2**floor(log2(L))`, which covers more than half of it, with at most
`log2(L) + 1` updates a request.

The rate is an exponentially decayed count divided by its time constant
`tau = half_life_s / ln 2`: each request adds `1 / tau`, and the sum decays by
`exp(-dt / tau)`. A prefix seen at a steady `r` requests a second converges to `r`;
one seen once shows `1 / tau` and halves every `half_life_s`.

Memory is bounded by `max_entries` anchors; the least recently seen one goes first.
Each entry keeps a copy of its prefix's keys (taken once, when the anchor is first
seen), which the caller needs to ask the index who holds it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from quillcache.errors import ConfigError
from quillcache.policy.targets import KeyArray


@dataclass(frozen=True, slots=True)
class HotPrefix:
    """A prefix whose decayed request rate is at least the asked minimum."""

    key: int  # its last content key
    blocks: int  # its length in full blocks
    rate: float  # requests a second starting with it, decayed to the asked time
    keys: KeyArray  # its chained content keys (`blocks` of them)


@dataclass(slots=True)
class _Entry:
    value: float  # decayed count / tau at `last_s`
    last_s: float
    keys: KeyArray
    parent: int | None  # the key of the anchor one level shallower, if any


def anchor_depths(blocks: int) -> list[int]:
    """The depths (in blocks) a request of `blocks` full blocks is counted at."""
    out: list[int] = []
    d = 1
    while d <= blocks:
        out.append(d)
        d *= 2
    return out


class HeatTracker:
    """Decayed request rates of prefix anchors (module docstring).

    `observe(keys, now_s)` counts one request; `hot(now_s, min_rate)` lists the prefixes
    at or above `min_rate`. Times are seconds on one monotonic clock; a time earlier
    than an entry's last update counts as that time (concurrent callers may race)."""

    def __init__(self, *, half_life_s: float = 10.0, max_entries: int = 4096) -> None:
        if not half_life_s > 0 or not math.isfinite(half_life_s):
            raise ConfigError(f"heat half_life_s must be positive and finite, got {half_life_s}")
        if max_entries <= 0:
            raise ConfigError(f"heat max_entries must be positive, got {max_entries}")
        self.half_life_s = half_life_s
        self.tau_s = half_life_s / math.log(2)
        self.max_entries = max_entries
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recently seen first
        self.evicted = 0  # entries dropped for room (a metric)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def _decayed(self, e: _Entry, now_s: float) -> float:
        dt = now_s - e.last_s
        return e.value * math.exp(-dt / self.tau_s) if dt > 0 else e.value

    def observe(self, keys: KeyArray, now_s: float) -> None:
        """Count one request whose full prompt blocks have these chained content keys
        (a 1-D uint64 array; empty: nothing to count)."""
        if not isinstance(keys, np.ndarray) or keys.dtype != np.uint64 or keys.ndim != 1:
            raise ConfigError("heat: keys must be a 1-D numpy uint64 array")
        entries, inc = self._entries, 1.0 / self.tau_s
        parent: int | None = None
        for d in anchor_depths(len(keys)):
            key = int(keys[d - 1])
            e = entries.get(key)
            if e is None:
                entries[key] = _Entry(inc, now_s, keys[:d].copy(), parent)
                if len(entries) > self.max_entries:
                    entries.popitem(last=False)
                    self.evicted += 1
            else:
                e.value = self._decayed(e, now_s) + inc
                e.last_s = max(e.last_s, now_s)
                entries.move_to_end(key)
            parent = key

    def rate(self, key: int, now_s: float) -> float:
        """The decayed rate of the anchor `key` (0 when not tracked)."""
        e = self._entries.get(key)
        return 0.0 if e is None else self._decayed(e, now_s)

    def hot(
        self, now_s: float, min_rate: float, *, min_blocks: int = 1, maximal: bool = True
    ) -> list[HotPrefix]:
        """The anchors of at least `min_blocks` blocks whose rate is at least `min_rate`,
        hottest first (ties: longer first, then lower key). With `maximal`, a hot anchor
        is left out when a deeper anchor extending it is hot too: replicating the deeper
        one places the shallower with it."""
        hot = {
            k: (e, r)
            for k, e in self._entries.items()
            if len(e.keys) >= min_blocks and (r := self._decayed(e, now_s)) >= min_rate
        }
        if maximal:
            covered = {e.parent for e, _ in hot.values() if e.parent is not None}
            hot = {k: v for k, v in hot.items() if k not in covered}
        out = [HotPrefix(k, len(e.keys), r, e.keys) for k, (e, r) in hot.items()]
        out.sort(key=lambda h: (-h.rate, -h.blocks, h.key))
        return out
