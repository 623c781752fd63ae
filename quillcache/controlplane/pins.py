"""Pinned prefixes as a routing preference: the control plane's stage before the router.

A pin names a prefix (a chain of content keys) an operator or a policy wants kept warm.
Keeping its index nodes is the index's job (`IndexBackend.pin`); this stage makes routing
honour it, for every router alike: a request that starts with a pinned prefix is routed
among the engines holding the whole prefix that still have room (their estimated queue
wait, from the plane's cost model and booked load, at most `max_wait_s`), and among all
candidates as usual when none has. The router still picks among the holders, so its own
balance (load, DP ranks, its tie rule) applies within them.

Content keys are namespaced by the tenant's salt (`identity.namespace`), so a pin only
ever matches its own tenant's requests: no tenant check is needed here.

A prefix pinned with an engine (a session's, bound to the engine that served its last
turn) is routed to that engine while it has room, whatever the index says yet: the
turn's blocks may still be on their way as events when the next turn comes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import numpy.typing as npt

#: The default bound on a holder's estimated queue wait for it to count as having room.
DEFAULT_MAX_WAIT_S = 1.0

KeyArray = npt.NDArray[np.uint64]


class PinnedPrefixes:
    """Which prefixes are pinned (reference-counted: the same prefix pinned twice stays
    pinned until unpinned twice), found in a request's keys by their last key."""

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s
        self._blocks: dict[int, int] = {}  # a pinned prefix's last key -> its length
        self._refs: dict[int, int] = {}
        self._engine: dict[int, int] = {}  # a bound prefix's last key -> its engine
        self._lasts: KeyArray = np.empty(0, dtype=np.uint64)  # sorted, for the lookup

    def __len__(self) -> int:
        return len(self._blocks)

    def add(self, keys: KeyArray, engine: int | None = None) -> None:
        if not len(keys):
            return
        last = int(keys[-1])
        self._refs[last] = self._refs.get(last, 0) + 1
        if engine is not None:
            self._engine[last] = engine
        if last not in self._blocks:
            self._blocks[last] = len(keys)
            self._rebuild()

    def remove(self, keys: KeyArray) -> None:
        if not len(keys):
            return
        last = int(keys[-1])
        refs = self._refs.get(last, 0) - 1
        if refs > 0:
            self._refs[last] = refs
            return
        if self._refs.pop(last, None) is not None:
            del self._blocks[last]
            self._engine.pop(last, None)
            self._rebuild()

    def _rebuild(self) -> None:
        self._lasts = np.array(sorted(self._blocks), dtype=np.uint64)

    def bound(self, keys: KeyArray, n: int) -> int | None:
        """The engine the pinned prefix `keys[:n]` is bound to, if any."""
        return self._engine.get(int(keys[n - 1])) if n else None

    def longest(self, keys: KeyArray) -> int:
        """The length in blocks of the longest pinned prefix `keys` starts with; 0 for
        none. A chained key names its whole prefix, so a pinned last key at position i
        means keys[: i + 1] is that pinned prefix."""
        if not len(self._blocks) or not len(keys):
            return 0
        at = np.flatnonzero(np.isin(keys, self._lasts, assume_unique=False))
        for i in at[::-1]:
            if self._blocks[int(keys[i])] == i + 1:
                return int(i) + 1
        return 0

    def prefer(
        self,
        keys: KeyArray,
        holders_of: Callable[[KeyArray], Iterable[int]],
        wait_s: Callable[[int], float],
    ) -> frozenset[int] | None:
        """The engines to route `keys` among for the longest pinned prefix they start
        with: its bound engine when it has one with room, else its holders
        (`holders_of(prefix)`, every engine holding all of it) whose `wait_s(engine)` is
        at most `max_wait_s`; None when the request starts with no pinned prefix or no
        engine has room."""
        n = self.longest(keys)
        if not n:
            return None
        engine = self.bound(keys, n)
        if engine is not None and wait_s(engine) <= self.max_wait_s:
            return frozenset({engine})
        roomy = frozenset(w for w in holders_of(keys[:n]) if wait_s(w) <= self.max_wait_s)
        return roomy or None
