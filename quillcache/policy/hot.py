"""Hot prefixes and what it takes to replicate them: their heat, and their tokens.

Replicating a prefix means sending it as a prompt (`gateway/actuator.py`), and the index
keeps no token ids, so the policy keeps them for the prefixes that are hot: a routed
request is counted at its anchors (`heat.HeatTracker`, O(anchors) a request), and an
anchor at or above `min_rate` (`local_min_rate`: with several replicas sharing their
heat, this replica's share of it) that has no copy yet gets one, cut from that request's
prompt at the anchor's depth. Nothing is copied for a prefix that is not hot.

An anchor covers a shared prefix only down to a power of two of blocks (a prompt of 24
shared blocks is hot at its 16-block anchor), and a replica of 16 blocks would leave a
router that follows the longest match on the holder of all 24. So a copy takes the
request's blocks beyond the anchor too (up to the next anchor's depth), and each later
request of the same owner through that anchor cuts it back to what the two share: the
copy converges on the longest prefix the anchor's requests have in common.

A copy is tenant-scoped: it records the owner whose request it came from (tenant, the
derived `cache_salt` the gateway sent the engine, the served model), and a replica is
sent with exactly that salt. The anchor's key is chained from the namespace that salt
derives, so another tenant's request (another salt) never has the same key and never
replaces or reuses the copy; a request whose owner differs from the copy's for the same
key (a shared namespace) leaves the first owner's copy in place.

The copies are bounded by `max_tokens` in all (least recently observed first out), and
a copy goes with its anchor when the tracker drops it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from quillcache.errors import ConfigError
from quillcache.policy.heat import HeatTracker, HotPrefix, anchor_depths
from quillcache.policy.targets import KeyArray


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a copy belongs to, and what a replica is sent with."""

    tenant: str
    salt: str | None
    model: str


@dataclass(frozen=True, slots=True)
class HotCopy:
    """A hot prefix (its anchor) with its owner, and the longest prefix its requests
    share through it: those blocks' keys and tokens (whole blocks, at least the
    anchor's)."""

    prefix: HotPrefix
    owner: Owner
    keys: KeyArray
    token_ids: list[int]


@dataclass(slots=True)
class _Copy:
    owner: Owner
    keys: KeyArray
    tokens: list[int]


class HotPrefixes:
    """The heat of routed requests' anchors, and the tokens of the hot ones (module
    docstring)."""

    def __init__(
        self,
        *,
        block_size: int,
        min_rate: float,
        min_blocks: int = 1,
        half_life_s: float = 5.0,
        max_anchors: int = 4096,
        max_tokens: int = 1 << 20,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"hot prefixes: block_size must be positive, got {block_size}")
        if not min_rate > 0:
            raise ConfigError(f"hot prefixes: min_rate must be positive, got {min_rate}")
        if min_blocks <= 0 or max_tokens < 0:
            raise ConfigError("hot prefixes: min_blocks must be >= 1 and max_tokens >= 0")
        self.block_size = block_size
        self.min_rate = min_rate
        # the rate at which an anchor gets a copy and is listed by `hot`: `min_rate`
        # alone; this replica's share of it when several replicas share their heat
        # (the caller then compares the fleet's rate with `min_rate`)
        self.local_min_rate = min_rate
        self.min_blocks = min_blocks
        self.max_tokens = max_tokens
        self.heat = HeatTracker(half_life_s=half_life_s, max_entries=max_anchors)
        # anchor key -> its copy, least recently observed first
        self._copies: OrderedDict[int, _Copy] = OrderedDict()
        self._tokens = 0
        self.copied = 0  # copies taken (a metric)
        self.dropped = 0  # copies dropped for room or with their anchor

    @property
    def tokens(self) -> int:
        return self._tokens

    def __len__(self) -> int:
        return len(self._copies)

    def copy_of(self, key: int) -> tuple[Owner, list[int]] | None:
        c = self._copies.get(key)
        return None if c is None else (c.owner, c.tokens)

    def observe(self, keys: KeyArray, tokens: Sequence[int], owner: Owner, now_s: float) -> None:
        """Count one routed request (its chained content keys, its prompt's token ids,
        its owner); copy the tokens of each of its anchors that is hot and has none."""
        self.heat.observe(keys, now_s)
        bs = self.block_size
        copies = self._copies
        for d in anchor_depths(len(keys)):
            if d < self.min_blocks:
                continue
            key = int(keys[d - 1])
            have = copies.get(key)
            if have is not None:
                if have.owner == owner:
                    copies.move_to_end(key)
                    self._cut(have, keys, d)
                continue
            if self.heat.rate(key, now_s) < self.local_min_rate or len(tokens) < d * bs:
                continue
            n = min(len(keys), 2 * d - 1, len(tokens) // bs)
            self._put(key, _Copy(owner, keys[:n].copy(), list(tokens[: n * bs])))

    def _cut(self, copy: _Copy, keys: KeyArray, d: int) -> None:
        """Cut `copy` (of an anchor at depth `d`) back to the blocks it shares with
        `keys`."""
        n = min(len(copy.keys), len(keys))
        if n == len(copy.keys) and (n == d or keys[n - 1] == copy.keys[n - 1]):
            return  # chained keys: the last shared block means every one before is
        differ = np.flatnonzero(copy.keys[d:n] != keys[d:n])
        keep = d + int(differ[0]) if len(differ) else n
        self._tokens -= len(copy.tokens) - keep * self.block_size
        copy.keys = copy.keys[:keep].copy()
        copy.tokens = copy.tokens[: keep * self.block_size]

    def _put(self, key: int, copy: _Copy) -> None:
        if len(copy.tokens) > self.max_tokens:
            return
        copies = self._copies
        while copies and self._tokens + len(copy.tokens) > self.max_tokens:
            _, old = copies.popitem(last=False)
            self._tokens -= len(old.tokens)
            self.dropped += 1
        copies[key] = copy
        self._tokens += len(copy.tokens)
        self.copied += 1

    def hot(self, now_s: float) -> list[HotCopy]:
        """The prefixes at or above `local_min_rate` that have a copy, hottest first;
        copies whose anchor the tracker dropped go first."""
        for key in [k for k in self._copies if k not in self.heat]:
            old = self._copies.pop(key)
            self._tokens -= len(old.tokens)
            self.dropped += 1
        out: list[HotCopy] = []
        for h in self.heat.hot(
            now_s, self.local_min_rate, min_blocks=self.min_blocks, maximal=False
        ):
            c = self._copies.get(h.key)
            if c is not None:
                out.append(HotCopy(h, c.owner, c.keys, c.tokens))
        return _maximal(out)

    def at_fleet_rates(
        self, copies: Sequence[HotCopy], replicas: int | None, rates: Sequence[float]
    ) -> list[HotCopy]:
        """The copies (`hot`'s) hot for the fleet, given what the replicas sharing their
        heat say (`replicas`, and the fleet's rate of each copy, in order): those whose
        fleet rate reaches `min_rate`, at that rate; from now on this replica copies and
        lists anchors at its share of `min_rate`. `replicas` None (the fleet's heat could
        not be read): this replica's own rate against the whole `min_rate`."""
        if replicas is None:
            self.local_min_rate = self.min_rate
            return [c for c in copies if c.prefix.rate >= self.min_rate]
        self.local_min_rate = self.min_rate / max(replicas, 1)
        return [
            replace(c, prefix=replace(c.prefix, rate=rate))
            for c, rate in zip(copies, rates, strict=False)
            if rate >= self.min_rate
        ]


def _maximal(hot: list[HotCopy]) -> list[HotCopy]:
    """Leave out a hot prefix that a deeper listed anchor of the same owner extends, with
    a copy at least as long: replicating the longer places the shorter with it."""
    out: list[HotCopy] = []
    for c in hot:
        n = c.prefix.blocks
        covered = any(
            len(o.keys) >= len(c.keys)
            and o.prefix.blocks > n
            and o.owner == c.owner
            and int(o.prefix.keys[n - 1]) == c.prefix.key
            for o in hot
        )
        if not covered:
            out.append(c)
    return out
