"""Where the control plane keeps each worker's load: the `LoadStore` interface and the
in-process store every plane uses today.

Load is what routing books and engines report: requests in flight, queued prefill
tokens, running decodes, KV usage, the running decodes' mean context, and the queued
prefill's attention pairs (`costmodel.prefill_pairs` of each queued request).

A booked request is named by its prefill tokens and its prompt tokens (the cached
context is the difference): the store derives its pairs, so that what a booking adds a
prefill or a release takes away exactly. Routers never
read a store; the plane reads it into the columns of a `View` (one row per worker, in
`LOAD_FIELDS` order). A store shared by several gateway replicas (Redis) implements
the same interface, so the routers and the plane's bookkeeping stay as they are.

A row is the plane's slot for a worker (`ControlPlane` allocates them); the store
keeps its matrix in those rows so that the plane reads a fleet's load with one slice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np
import numpy.typing as npt

from quillcache.costmodel.model import booked_pairs
from quillcache.errors import ConfigError
from quillcache.routing.types import LOAD_FIELDS

IN_FLIGHT, QUEUED, DECODES, KV_USAGE, MEAN_CONTEXT, PAIRS = range(len(LOAD_FIELDS))
_COLUMN = {name: i for i, name in enumerate(LOAD_FIELDS)}


def load_column(name: str) -> int:
    """The matrix column of a load field; ConfigError naming the known ones."""
    try:
        return _COLUMN[name]
    except KeyError:
        raise ConfigError(f"unknown load field {name!r}; known: {sorted(LOAD_FIELDS)}") from None


class LoadStore(Protocol):
    """Per-worker load, booked by routing and reported by engines."""

    def add(self, row: int) -> None:
        """A worker took `row`: its load starts at zero."""
        ...

    def report(self, row: int, values: Mapping[int, float]) -> None:
        """Engine-reported values (or the driver's own figures), by column, replace
        those fields of the row: one change, however many fields."""
        ...

    def book(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        """A request was routed here: one more in flight, its prefill queued."""
        ...

    def prefilled(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        """A booked request finished its prefill and decodes now (its context: the
        prompt)."""
        ...

    def release(
        self, row: int, prefill_tokens: float, prompt_tokens: float, prefilled: bool
    ) -> None:
        """A booked request ended (done or failed)."""
        ...

    def value(self, row: int, column: int) -> float: ...

    def rows(self, rows: npt.NDArray[np.intp] | slice) -> npt.NDArray[np.float64]:
        """The load matrix's `rows` (a slice is a view, not a copy)."""
        ...

    def watch(self, listener: Callable[[int], None]) -> None:
        """Call `listener(row)` after every change of a row's values, whoever makes it
        (the plane keeps its rows in load order with it: controlplane/order.py)."""
        ...


class LocalLoadStore:
    """One process's load: a float64 matrix, one row per worker slot."""

    def __init__(self, rows: int = 64) -> None:
        self._m = np.zeros((max(rows, 1), len(LOAD_FIELDS)), dtype=np.float64)
        self._listeners: list[Callable[[int], None]] = []

    def watch(self, listener: Callable[[int], None]) -> None:
        self._listeners.append(listener)

    def _changed(self, row: int) -> None:
        for listener in self._listeners:
            listener(row)

    def add(self, row: int) -> None:
        if row >= len(self._m):
            grown = np.zeros((max(row + 1, 2 * len(self._m)), len(LOAD_FIELDS)))
            grown[: len(self._m)] = self._m
            self._m = grown
        self._m[row] = 0.0
        self._changed(row)

    def report(self, row: int, values: Mapping[int, float]) -> None:
        r = self._m[row]
        for column, value in values.items():
            r[column] = value
        self._changed(row)

    def book(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        r = self._m[row]
        r[IN_FLIGHT] += 1
        r[QUEUED] += prefill_tokens
        r[PAIRS] += booked_pairs(prefill_tokens, prompt_tokens)
        self._changed(row)

    def prefilled(self, row: int, prefill_tokens: float, prompt_tokens: float) -> None:
        r = self._m[row]
        self._unqueue(r, prefill_tokens, prompt_tokens)
        decodes = r[DECODES]
        r[MEAN_CONTEXT] = (r[MEAN_CONTEXT] * decodes + prompt_tokens) / (decodes + 1)
        r[DECODES] = decodes + 1
        self._changed(row)

    def release(
        self, row: int, prefill_tokens: float, prompt_tokens: float, prefilled: bool
    ) -> None:
        r = self._m[row]
        r[IN_FLIGHT] = max(r[IN_FLIGHT] - 1, 0.0)
        if prefilled:
            r[DECODES] = max(r[DECODES] - 1, 0.0)
        else:
            self._unqueue(r, prefill_tokens, prompt_tokens)
        self._changed(row)

    @staticmethod
    def _unqueue(r: npt.NDArray[np.float64], prefill_tokens: float, prompt_tokens: float) -> None:
        r[QUEUED] = max(r[QUEUED] - prefill_tokens, 0.0)
        pairs = booked_pairs(prefill_tokens, prompt_tokens)
        r[PAIRS] = max(r[PAIRS] - pairs, 0.0)

    def value(self, row: int, column: int) -> float:
        return float(self._m[row, column])

    def rows(self, rows: npt.NDArray[np.intp] | slice) -> npt.NDArray[np.float64]:
        return self._m[rows]
