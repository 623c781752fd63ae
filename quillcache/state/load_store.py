"""`SharedLoadStore`: the control plane's `LoadStore` when several gateway replicas share
their booked load through Redis, so that the routers see the whole fleet's load.

What the plane reads for a row (an engine's dp rank) is

    the fleet's booked load (every live replica's bookings, from Redis)
    + what the engine's own gauges show above it (`report`, from the scrape merge)

The booked part is fed from three places: a poll of `RedisFleetState.loads()` (every
`poll_s`, a background task of the gateway), the shortlist's loads a booking's reply
carries, and this replica's own bookings, prefills and releases, applied the moment they
happen (`own_booked` ...), so that a replica's burst moves its own view at once. A poll
replaces the booked part; the difference is added to what the plane reads, so the part
the scrape merge put on top stays (the merge reads `value()`, takes off what it added
last time, and reports the larger of that and the engine's count).

The plane's own `book` / `prefilled` / `release` are ignored here: they name the row the
router chose, and the booking step may take another one. The shared booking layer
(`quillcache.gateway.shared_routing`) applies the booked row instead.

Between a poll's read in Redis and its reply, this replica's bookings are counted, then
overwritten by a snapshot that misses them: an undercount of at most the bookings of one
round trip, corrected by the next poll.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import numpy as np
import numpy.typing as npt

from quillcache.controlplane.load import DECODES, IN_FLIGHT, MEAN_CONTEXT, PAIRS, QUEUED
from quillcache.costmodel.model import booked_pairs
from quillcache.routing.types import LOAD_FIELDS
from quillcache.state.types import EngineKey, SharedLoad

# the booked part's columns: in flight, queued, decodes, context, queued pairs
_N, _Q, _D, _C, _P = range(5)
_COUNTS = [IN_FLIGHT, QUEUED, DECODES, PAIRS]  # what the plane reads of _N, _Q, _D, _P
_BOOKED_COUNTS = [_N, _Q, _D, _P]

RowOf = Callable[[EngineKey], int | None]


class SharedLoadStore:
    """A `LoadStore` (quillcache/controlplane/load.py) over the fleet's shared load."""

    def __init__(self, rows: int = 64) -> None:
        rows = max(rows, 1)
        self._m = np.zeros((rows, len(LOAD_FIELDS)), dtype=np.float64)  # what the plane reads
        self._booked = np.zeros((rows, 5), dtype=np.float64)  # the booked part in `_m`
        self._row_of: RowOf = lambda key: None
        self.polls = 0  # snapshots applied (shared or local)
        self._listeners: list[Callable[[int], None]] = []

    def bind(self, row_of: RowOf) -> None:
        """How an engine key maps to a plane row (the plane is built after this store)."""
        self._row_of = row_of

    # --- the LoadStore protocol -----------------------------------------------------

    def watch(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)

    def _changed(self, row: int) -> None:
        for listener in self._listeners:
            listener(row)

    def add(self, row: int) -> None:
        if row >= len(self._m):
            size = max(row + 1, 2 * len(self._m))
            for name in ("_m", "_booked"):
                old = getattr(self, name)
                grown = np.zeros((size, old.shape[1]), dtype=np.float64)
                grown[: len(old)] = old
                setattr(self, name, grown)
        self._m[row] = 0.0
        self._booked[row] = 0.0
        self._changed(row)

    def report(self, row: int, values: Mapping[int, float]) -> None:
        r = self._m[row]
        for column, value in values.items():
            r[column] = value
        self._changed(row)

    def book(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        """Ignored: the booking step books the row it took (`own_booked`)."""

    def prefilled(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        """Ignored: see `own_prefilled`."""

    def release(
        self, row: int, prefill_tokens: float, prompt_tokens: float, prefilled: bool
    ) -> None:
        """Ignored: see `own_released`."""

    def value(self, row: int, column: int) -> float:
        return float(self._m[row, column])

    def rows(self, rows: npt.NDArray[np.intp] | slice) -> npt.NDArray[np.float64]:
        return self._m[rows]

    # --- the fleet's booked load ----------------------------------------------------

    def apply_snapshot(self, loads: Mapping[EngineKey, SharedLoad]) -> None:
        """The whole fleet's booked load (a poll): keys absent carry none."""
        new = np.zeros_like(self._booked)
        for key, ld in loads.items():
            row = self._row_of(key)
            if row is not None and row < len(new):
                new[row] = (ld.in_flight, ld.queued_prefill_tokens, ld.running_decodes,
                            ld.context_tokens, ld.queued_prefill_pairs)  # fmt: skip
        self._move(slice(None), new)
        self.polls += 1

    def apply_some(self, loads: Iterable[tuple[EngineKey, SharedLoad]]) -> None:
        """Some keys' booked load (a booking's reply: its shortlist before it). A row
        that would not move is left alone, unmarked: a booking's reply mostly repeats
        what this store holds, and a marked row is placed again in the plane's load
        orders before the next decision."""
        booked, m = self._booked, self._m
        for key, ld in loads:
            row = self._row_of(key)
            if row is None or row >= len(booked):
                continue
            n, q, d = ld.in_flight, ld.queued_prefill_tokens, ld.running_decodes
            c, p = ld.context_tokens, ld.queued_prefill_pairs
            if booked[row].tolist() == [n, q, d, c, p] and self._still(m[row].tolist(), c, d):
                continue
            self._move_row(row, n, q, d, c, p)

    def own_booked(self, key: EngineKey, prefill_tokens: int, prompt_tokens: int) -> None:
        p = booked_pairs(prefill_tokens, prompt_tokens)
        self._step(key, n=1, q=prefill_tokens, p=p)

    def own_prefilled(self, key: EngineKey, prefill_tokens: int, prompt_tokens: int) -> None:
        p = booked_pairs(prefill_tokens, prompt_tokens)
        self._step(key, q=-prefill_tokens, p=-p, d=1, c=prompt_tokens)

    def own_released(
        self, key: EngineKey, prefill_tokens: int, prompt_tokens: int, prefilled: bool
    ) -> None:
        if prefilled:
            self._step(key, n=-1, d=-1, c=-prompt_tokens)
        else:
            p = booked_pairs(prefill_tokens, prompt_tokens)
            self._step(key, n=-1, q=-prefill_tokens, p=-p)

    def booked(self, key: EngineKey) -> SharedLoad:
        """The booked part of a key's load as this store holds it (tests, /admin)."""
        row = self._row_of(key)
        if row is None or row >= len(self._booked):
            return SharedLoad()
        n, q, d, c, p = (round(float(v)) for v in self._booked[row])
        return SharedLoad(n, q, d, c, p)

    def _step(
        self, key: EngineKey, n: int = 0, q: int = 0, d: int = 0, c: int = 0, p: float = 0.0
    ) -> None:
        row = self._row_of(key)
        if row is None or row >= len(self._booked):
            return
        b = self._booked[row]
        self._move_row(
            row,
            max(float(b[_N]) + n, 0.0),
            max(float(b[_Q]) + q, 0.0),
            max(float(b[_D]) + d, 0.0),
            max(float(b[_C]) + c, 0.0),
            max(float(b[_P]) + p, 0.0),
        )

    @staticmethod
    def _still(m: list[float], c: float, d: float) -> bool:
        """Whether `_move_row` with the booked part unchanged would leave the row `m` as
        it is: its counts not below zero, its mean context the booked one."""
        return (
            m[IN_FLIGHT] >= 0.0
            and m[QUEUED] >= 0.0
            and m[DECODES] >= 0.0
            and m[PAIRS] >= 0.0
            and m[MEAN_CONTEXT] == (c / d if d > 0 else 0.0)
        )

    def _move_row(self, row: int, n: float, q: float, d: float, c: float, p: float) -> None:
        """`_move` of one row in scalars: a booking moves a few rows, and numpy's
        per-call overhead on a one-row slice is many times the arithmetic."""
        b, m = self._booked[row], self._m[row]
        for col, new, at in ((IN_FLIGHT, n, _N), (QUEUED, q, _Q), (DECODES, d, _D), (PAIRS, p, _P)):
            m[col] = max(float(m[col]) + new - float(b[at]), 0.0)
        m[MEAN_CONTEXT] = c / d if d > 0 else 0.0
        b[_N], b[_Q], b[_D], b[_C], b[_P] = n, q, d, c, p
        self._changed(row)

    def _move(self, rows: slice, new: npt.NDArray[np.float64]) -> None:
        """Replace the booked part of `rows` by `new`; what the plane reads moves by the
        difference (never below zero), and the decodes' mean context follows the
        booked decodes."""
        delta = new - self._booked[rows]
        m = self._m[rows]
        m[:, _COUNTS] = np.maximum(m[:, _COUNTS] + delta[:, _BOOKED_COUNTS], 0.0)
        decodes = new[:, _D]
        m[:, MEAN_CONTEXT] = np.divide(
            new[:, _C], decodes, out=np.zeros_like(decodes), where=decodes > 0
        )
        self._m[rows] = m
        self._booked[rows] = new
        if self._listeners:
            for row in range(*rows.indices(len(self._m))):
                self._changed(row)
