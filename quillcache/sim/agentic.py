"""Dynamo's agentic Mooncake trace fields: who waits for whom, and for how long.

NVIDIA Dynamo's `AgenticMooncakeRow` (ai-dynamo/dynamo, lib/data-gen/src/mooncake.rs;
written by its `agent_trace_to_mooncake --agentic` converter) adds to a Mooncake row:

- `request_id` (string): names the row.
- `wait_for` (list of request ids): the rows whose completion this one waits for.
- `branches` (list of request ids): the sub-agent rows this one spawns (each of them
  also waits for it).
- `delay` (alias `delay_ms`) and `tool_wait_ms` (ms, >= 0): once every dependency has
  completed, the replay waits their sum before sending the row.
- `prefix_reset` (bool): the row starts a trajectory (its prompt does not extend the
  previous row's context). The hash ids already say what is shared, so the simulator
  only checks the flag's type and counts it.
- `session_id` (string): the trajectory; the simulator passes it to routers.

A row without dependencies is sent at its `timestamp` (open loop); a row with some needs
no `timestamp` (open loop, it is then sent when its dependencies were, plus its wait).
Dependencies point to earlier lines (`wait_for`) or later ones (`branches`), as the
converter writes them in start order, so a trace cannot hold a cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quillcache.errors import ConfigError
from quillcache.sim.requests import SimRequest


class TraceFieldError(ConfigError):
    """A trace line has a field whose value the format does not allow."""

    def __init__(self, path: Path, line: int, field_name: str, problem: str) -> None:
        self.path = path
        self.line = line
        self.field = field_name
        super().__init__(f"{path}:{line}: field {field_name!r}: {problem}")


@dataclass(frozen=True, slots=True)
class AgenticRow:
    """A row's agentic fields, checked."""

    request_id: str | None = None
    session_id: str | None = None
    wait_for: tuple[str, ...] = ()
    branches: tuple[str, ...] = ()
    prefix_reset: bool | None = None
    wait_s: float = 0.0  # (delay + tool_wait_ms) / 1000
    wait_field: str | None = None  # the field that set a nonzero wait (for errors)


def _ids(value: Any, path: Path, line: int, name: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise TraceFieldError(path, line, name, f"must be a list of request ids, got {value!r}")
    return tuple(value)


def _ms(value: Any, path: Path, line: int, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TraceFieldError(path, line, name, f"must be a number of ms, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise TraceFieldError(path, line, name, f"must be finite and >= 0 ms, got {value!r}")
    return float(value)


def agentic_row(rec: dict[str, Any], path: Path, line: int) -> AgenticRow:
    """The agentic fields of one decoded JSONL record (all optional)."""
    rid = rec.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise TraceFieldError(path, line, "request_id", f"must be a string, got {rid!r}")
    session = rec.get("session_id")
    if session is not None and not isinstance(session, str):
        raise TraceFieldError(path, line, "session_id", f"must be a string, got {session!r}")
    wait_for = _ids(rec.get("wait_for", []), path, line, "wait_for")
    branches = _ids(rec.get("branches", []), path, line, "branches")
    if (wait_for or branches) and rid is None:
        raise TraceFieldError(
            path, line, "request_id", "a row with wait_for or branches needs a request_id"
        )
    reset = rec.get("prefix_reset")
    if reset is not None and not isinstance(reset, bool):
        raise TraceFieldError(path, line, "prefix_reset", f"must be true or false, got {reset!r}")
    if "delay" in rec and "delay_ms" in rec:
        raise TraceFieldError(path, line, "delay", "give delay or its alias delay_ms, not both")
    delay_name = "delay_ms" if "delay_ms" in rec else "delay"
    delay = rec.get(delay_name)
    tool = rec.get("tool_wait_ms")
    delay_ms = 0.0 if delay is None else _ms(delay, path, line, delay_name)
    tool_ms = 0.0 if tool is None else _ms(tool, path, line, "tool_wait_ms")
    wait_field = delay_name if delay_ms else ("tool_wait_ms" if tool_ms else None)
    return AgenticRow(
        rid, session, wait_for, branches, reset, (delay_ms + tool_ms) / 1000.0, wait_field
    )


@dataclass
class Dependencies:
    """Resolves request ids to request positions while a trace is read, then applies
    `branches` and checks that only dependent rows carry a wait."""

    path: Path
    _rid_of: dict[str, int] = field(default_factory=dict)
    _arrival: list[float] = field(default_factory=list)
    _branches: list[tuple[int, int, str]] = field(default_factory=list)  # line, parent, id
    _rows: list[tuple[int, AgenticRow]] = field(default_factory=list)  # line, row
    prefix_resets: int = 0

    @property
    def any(self) -> bool:
        return any(row.wait_for or row.branches for _, row in self._rows)

    def add(
        self, line: int, row: AgenticRow, timestamp_s: float | None
    ) -> tuple[tuple[int, ...], float]:
        """Register the next row (position = rows so far); its parents (positions) from
        `wait_for` and its open-loop arrival (its timestamp, else its parents' latest
        arrival plus its wait)."""
        pos = len(self._rows)
        parents: list[int] = []
        for dep in row.wait_for:
            p = self._rid_of.get(dep)
            if p is None:
                raise TraceFieldError(
                    self.path, line, "wait_for", f"{dep!r} is not the request_id of an earlier line"
                )
            if p not in parents:
                parents.append(p)
        if timestamp_s is None:
            if not parents:
                raise TraceFieldError(
                    self.path, line, "timestamp", "missing (a row without wait_for needs one)"
                )
            timestamp_s = max(self._arrival[p] for p in parents) + row.wait_s
        if row.request_id is not None:
            if row.request_id in self._rid_of:
                raise TraceFieldError(
                    self.path,
                    line,
                    "request_id",
                    f"{row.request_id!r} already names line "
                    f"{self._rows[self._rid_of[row.request_id]][0]}",
                )
            self._rid_of[row.request_id] = pos
        self._branches.extend((line, pos, child) for child in row.branches)
        self._rows.append((line, row))
        self._arrival.append(timestamp_s)
        self.prefix_resets += bool(row.prefix_reset)
        return tuple(parents), timestamp_s

    def finish(self, reqs: list[SimRequest], *, truncated: bool) -> None:
        """Add each `branches` child's parent and give dependent requests their wait;
        `reqs` in line order. With `truncated` (a --limit), branches to rows not read
        are dropped."""
        for line, parent, child in self._branches:
            c = self._rid_of.get(child)
            if c is None and truncated:
                continue
            if c is None or c <= parent:
                raise TraceFieldError(
                    self.path, line, "branches", f"{child!r} is not the request_id of a later line"
                )
            if reqs[parent].rid not in reqs[c].parents:
                reqs[c].parents = (*reqs[c].parents, reqs[parent].rid)
        for (line, row), r in zip(self._rows, reqs, strict=True):
            if row.wait_field is None:
                continue
            if not r.parents:
                raise TraceFieldError(
                    self.path,
                    line,
                    row.wait_field,
                    "a wait after dependencies, but the row has no wait_for and no row "
                    "branches to it",
                )
            r.wait_s = row.wait_s
