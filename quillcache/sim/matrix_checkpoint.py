"""A matrix's runs, kept as they finish (`DIR/runs.jsonl`), so a grid that is stopped
(a SIGKILL, a closed terminal, a machine that went away) resumes where it stopped
instead of starting over: `quillcache simulate --matrix GRID --out DIR` run again with
the same grid skips the runs the file holds.

The file is JSON lines. The first names the grid it belongs to (`fingerprint`: a
digest of everything that decides a run's numbers: the routers, seeds, cells, each
workload's description and trace bytes, each setup's cost model, and QuillCache's
version); every other line is one finished run (its task, its kept metrics or its
error, its CPU seconds). A line is written whole and flushed as its run ends, so a
process killed mid-write leaves at most one partial last line, which is dropped on
resume. A file from another grid is refused (it would mix numbers of two grids);
`--fresh` discards it. Failed runs are not kept: a resume runs them again.

Resuming across a code change is the user's call: the version in the fingerprint is
the package's, which an edited checkout does not change.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from quillcache.errors import ConfigError
from quillcache.sim.matrix import Grid, Task, TaskResult, tasks_of

#: The checkpoint's name in a matrix's output directory.
CHECKPOINT_NAME = "runs.jsonl"
_FORMAT = 1


def fingerprint(grid: Grid) -> str:
    """A digest of what decides the grid's numbers (not its name or description)."""
    try:
        version = importlib.metadata.version("quillcache")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    traces = {}
    for name, spec in grid.workloads.items():
        if spec.trace_path is not None:
            traces[name] = hashlib.sha256(Path(spec.trace_path).read_bytes()).hexdigest()
    described = {
        "format": _FORMAT,
        "version": version,
        "routers": grid.routers,
        "seeds": grid.seeds,
        "cells": [c.key() for c in grid.cells],
        "workloads": {n: w.describe() for n, w in grid.workloads.items()},
        "traces": traces,
        "setups": {n: s.config().model_dump(mode="json") for n, s in grid.setups.items()},
    }
    text = json.dumps(described, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass
class Checkpoint:
    """The runs already done (task index -> result) and the file new ones go to."""

    path: Path
    done: dict[int, TaskResult] = field(default_factory=dict)
    dropped_partial_line: bool = False
    _file: IO[str] | None = None

    @classmethod
    def open(cls, path: Path, grid: Grid, *, fresh: bool = False) -> Checkpoint:
        """Read `path` (a matching grid's finished runs) and keep it open to append;
        a new file when there is none or `fresh`. ConfigError when it belongs to
        another grid or is not a checkpoint."""
        digest = fingerprint(grid)
        index = {task: i for i, task in enumerate(tasks_of(grid))}
        cp = cls(path)
        if path.exists() and not fresh:
            cp._read(digest, index)
        else:
            cp._start(digest)
        cp._file = path.open("a", encoding="utf-8")
        return cp

    def _start(self, digest: str) -> None:
        header = {"quillcache_matrix_checkpoint": _FORMAT, "fingerprint": digest}
        self._write_atomically(json.dumps(header) + "\n")

    def _write_atomically(self, text: str) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            raise ConfigError(f"cannot write {self.path}: {exc.strerror or exc}") from None

    def _read(self, digest: str, index: dict[Task, int]) -> None:
        try:
            raw = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read the checkpoint {self.path}: {exc}") from None
        lines = raw.split("\n")
        refuse = (
            f"{self.path} is not a checkpoint of this grid ({{why}}): give --fresh to "
            f"discard it, or another --out"
        )
        try:
            header = json.loads(lines[0])
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or "quillcache_matrix_checkpoint" not in header:
            raise ConfigError(refuse.format(why="no checkpoint header on its first line"))
        if header.get("fingerprint") != digest:
            raise ConfigError(
                refuse.format(why="written for another grid, setup, trace or QuillCache version")
            )
        kept = [lines[0]]
        body = lines[1:]
        # (the text ends with "\n": the last piece is empty unless a write was cut)
        if body and body[-1] != "":
            self.dropped_partial_line = True
        for n, line in enumerate(body[:-1], start=2):
            try:
                rec = json.loads(line)
                task = (int(rec["task"][0]), int(rec["task"][1]), str(rec["task"][2]))
                result: TaskResult = (rec["kept"], float(rec["cpu_s"]), None)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError, IndexError):
                raise ConfigError(
                    f"{self.path}, line {n}: not a run record; give --fresh to discard "
                    f"the checkpoint"
                ) from None
            i = index.get(task)
            if i is None:
                raise ConfigError(refuse.format(why=f"line {n} names a run the grid has not"))
            self.done[i] = result
            kept.append(line)
        if self.dropped_partial_line:
            # rewrite without the cut line, so the next record starts on a line of its own
            self._write_atomically("\n".join(kept) + "\n")

    def record(self, task: Task, result: TaskResult) -> None:
        """Keep a finished run (a failed one is not kept: a resume retries it)."""
        kept, cpu_s, error = result
        if error is not None or kept is None:
            return
        assert self._file is not None, "record() after close()"
        line = json.dumps({"task": list(task), "kept": kept, "cpu_s": cpu_s})
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def resumed(self) -> int:
        return len(self.done)
