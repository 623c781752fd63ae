"""The plane's rows kept in order of their load, for routers that prune (`View.prunable`).

A fleet's requests share a first block that every engine holds, and a conversation's
prefix sits on one to three engines, so most rows of a view hold exactly the same part
of a request (the floor). A router whose choice among those rows is monotone in some
load fields (the fewest requests in flight; the shortest queue for an estimated TTFT)
only needs the rows above the floor plus the least loaded few of the rest. Finding those
few must not cost a pass over the fleet, so the plane keeps, per set of fields a router
asked for, an ordered structure (`quillcache._native.LoadOrder`, a B-tree) that follows
every change of the load.

Changes arrive through the `LoadStore`'s watch (bookings, releases, reports, a shared
store's polls) and are applied when an order is next read: a request's booking and
release touch one row a few times, which is placed once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from quillcache._native import LoadOrder
from quillcache.controlplane.load import LoadStore, load_column
from quillcache.index import MatchColumns

_T = TypeVar("_T", bound=np.generic)


class Candidates(Protocol):
    """A view's candidate rows (the plane's `_Candidates`)."""

    @property
    def row_position(self) -> npt.NDArray[np.intp]:
        """By plane row: its position in the view, -1 when not a candidate."""
        ...

    def position_list(self, workers: list[int], ranks: list[int]) -> list[int]:
        """Each (worker, rank)'s position, -1 for the others."""
        ...

    def rank_positions(
        self, workers: npt.NDArray[np.uint64], ranks: npt.NDArray[np.uint32]
    ) -> npt.NDArray[np.intp]:
        """`position_list` as arrays."""
        ...


#: Up to this many changed rows are placed one by one, more with one array call.
_FEW_ROWS = 16


class LoadOrders:
    """The orders asked for so far, kept up to date with a `LoadStore`'s rows."""

    def __init__(self, load: LoadStore) -> None:
        self._load = load
        self._orders: dict[tuple[int, ...], LoadOrder] = {}
        self._by_fields: dict[tuple[str, ...], LoadOrder] = {}  # `order`'s cache by names
        self._dirty: set[int] = set()
        # per plane row: its worker and rank (the ties' order), and whether a worker
        # holds it
        self._worker = np.zeros(64, dtype=np.uint64)
        self._rank = np.zeros(64, dtype=np.uint32)
        self._live = np.zeros(64, dtype=np.bool_)
        load.watch(self.changed)

    def changed(self, row: int) -> None:
        """A row's load changed (the store's watch)."""
        if self._orders:
            self._dirty.add(row)

    def assign(self, rows: Sequence[int], worker: int) -> None:
        """`worker` holds `rows` (rank i: `rows[i]`)."""
        top = max(rows) + 1
        if top > len(self._live):
            size = max(top, 2 * len(self._live))
            self._worker = _grown(self._worker, size)
            self._rank = _grown(self._rank, size)
            self._live = _grown(self._live, size)
        for rank, row in enumerate(rows):
            self._worker[row] = worker
            self._rank[row] = rank
            self._live[row] = True
            self._dirty.add(row)

    def release(self, rows: Sequence[int]) -> None:
        """No worker holds `rows` any more."""
        for row in rows:
            self._live[row] = False
            self._dirty.discard(row)
            for order in self._orders.values():
                order.remove(row)

    def order(self, fields: tuple[str, ...]) -> LoadOrder:
        """The rows in order of `fields` (`LOAD_FIELDS` names), worker id, rank."""
        order = self._by_fields.get(fields)
        if order is None:
            columns = tuple(load_column(f) for f in fields)
            order = self._orders.get(columns)
            if order is None:
                order = LoadOrder(len(columns))
                rows = np.flatnonzero(self._live)
                self._place(order, columns, rows)
                self._orders[columns] = order
            self._by_fields[fields] = order
        if self._dirty:
            self._flush()
        return order

    def _flush(self) -> None:
        dirty = self._dirty
        if len(dirty) > _FEW_ROWS:
            rows = np.fromiter(dirty, dtype=np.intp, count=len(dirty))
            rows = rows[self._live[rows]]
            for cols, o in self._orders.items():
                self._place(o, cols, rows)
        else:  # a request's booking and release: numpy calls cost more than the rows
            live, load = self._live, self._load
            for row in dirty:
                if not live[row]:
                    continue
                worker, rank = int(self._worker[row]), int(self._rank[row])
                for cols, o in self._orders.items():
                    o.set(row, [load.value(row, c) for c in cols], worker, rank)
        dirty.clear()

    def _place(
        self, order: LoadOrder, columns: tuple[int, ...], rows: npt.NDArray[np.intp]
    ) -> None:
        if not len(rows):
            return
        values = np.ascontiguousarray(self._load.rows(rows)[:, list(columns)])
        order.set_many(rows.astype(np.int64), values, self._worker[rows], self._rank[rows])


def _grown(a: npt.NDArray[_T], size: int) -> npt.NDArray[_T]:
    out = np.zeros(size, dtype=a.dtype)
    out[: len(a)] = a
    return out


class PlaneRowOrder:
    """A view's `RowOrder`: the plane's orders read through the view's candidates."""

    __slots__ = ("_candidates", "_hits", "_orders", "_pending", "_special")

    def __init__(
        self,
        orders: LoadOrders,
        candidates: Candidates,
        hits: MatchColumns | None,
        pending: npt.NDArray[np.intp],
    ) -> None:
        self._orders = orders
        self._candidates = candidates
        self._hits = hits  # the match above the floors (all of it when not compact)
        self._pending = pending  # positions of the rows with pending blocks
        self._special: npt.NDArray[np.intp] | None = None

    def least_loaded(self, fields: tuple[str, ...], k: int) -> npt.NDArray[np.intp]:
        return self._orders.order(fields).first(k, self._candidates.row_position)

    def load_order(self, fields: tuple[str, ...]) -> tuple[LoadOrder, npt.NDArray[np.intp]]:
        return self._orders.order(fields), self._candidates.row_position

    def above_floor(self) -> npt.NDArray[np.intp]:
        if self._special is None:
            # a handful of positions: Python's sets beat numpy's set operations here
            h = self._hits
            if h is not None and len(h.worker) > _FEW_ROWS:
                # no floor (an engine that holds nothing yet): the match lists most rows
                at = self._candidates.rank_positions(h.worker, h.dp_rank)
                both = np.concatenate((at, self._pending))
                self._special = np.unique(both[both >= 0])
                return self._special
            special = set(self._pending.tolist())
            if h is not None and len(h.worker):
                if h.positions is not None:  # placed by the index as it matched
                    special.update(h.positions)
                else:
                    special.update(
                        self._candidates.position_list(h.worker.tolist(), h.dp_rank.tolist())
                    )
            special.discard(-1)
            self._special = np.asarray(sorted(special), dtype=np.intp)
        return self._special
