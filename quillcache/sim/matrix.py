"""The matrix: one command replays a grid of cells (workload x setup x engines x arrival
time scale, plus named cells) with every router and several seeds, and says per cell
which router wins and whether QuillCache's own policy is best or within the best
router's seed-to-seed spread.

A grid is a TOML file (Python's own `tomllib`: no dependency) or the name of a shipped
grid (`quillcache.sim.grids`); its format is in docs/simulator.md, "The matrix". The
runs are independent: `--jobs N` spreads them over N forked processes, `--ray` over a
Ray cluster (`quillcache.sim.matrix_ray`), and the results do not depend on where they
ran (each run is deterministic for its seed, results come back in task order). A run
that fails is reported with its error in its cell, never left out silently.
"""

from __future__ import annotations

import inspect
import math
import os
import re
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.costmodel.setups import SETUPS
from quillcache.errors import ConfigError, QuillCacheError
from quillcache.sim.generators import GENERATORS, checked_params
from quillcache.sim.workload import Workload

if TYPE_CHECKING:
    from quillcache.sim.matrix_checkpoint import Checkpoint

#: The policy the results page judges: QuillCache's own router.
OWN_ROUTER = "quillcache"
#: Environment variable naming a directory of traces (a grid's `trace = "name.jsonl"`).
TRACE_DIR_ENV = "QUILLCACHE_TRACE_DIR"

# The generators' parameters as `quillcache simulate --workload NAME` runs them (its
# flags' defaults), so a matrix cell and that command replay the same requests.
_CLI_SHARED_PREFIX = {
    "requests": 1500,
    "prefix_groups": 64,
    "shared_prefix_blocks": 128,
    "unique_blocks": 32,
    "output_tokens": 128,
    "rate": 30.0,
    "zipf": 1.0,
}


@dataclass(frozen=True)
class WorkloadSpec:
    """A trace file or a generator with parameters (the seed is the run's)."""

    name: str
    generator: str | None = None
    params: tuple[tuple[str, Any], ...] = ()
    trace: str | None = None  # as written in the grid
    trace_path: str | None = None  # resolved, when the trace was found
    block_size: int = 512  # a trace's tokens per block id
    limit: int | None = None

    def describe(self) -> str:
        if self.trace is not None:
            return f"trace {self.trace}" + (f" (first {self.limit})" if self.limit else "")
        assert self.generator is not None
        defaults = {
            k: p.default
            for k, p in inspect.signature(GENERATORS[self.generator]).parameters.items()
            if k not in ("seed", "model")
        }
        shown = ", ".join(f"{k}={v}" for k, v in {**defaults, **dict(self.params)}.items())
        return f"{self.generator} ({shown})"


BUILTIN_WORKLOADS: dict[str, WorkloadSpec] = {
    "mooncake": WorkloadSpec("mooncake", trace="mooncake_conversation_trace.jsonl"),
    "shared-prefix": WorkloadSpec(
        "shared-prefix", "shared-prefix", tuple(_CLI_SHARED_PREFIX.items())
    ),
    "sglang-gsp": WorkloadSpec("sglang-gsp", "sglang-gsp"),
    "multi-turn": WorkloadSpec("multi-turn", "multi-turn"),
    "agent-fanout": WorkloadSpec("agent-fanout", "agent-fanout"),
}


@dataclass(frozen=True)
class SetupSpec:
    """A named setup (quillcache.costmodel.setups) with cost-model overrides."""

    name: str
    base: str
    cost: tuple[tuple[str, Any], ...] = ()

    def config(self) -> CostModelConfig:
        cfg = SETUPS[self.base].config
        return cfg.with_overrides(dict(self.cost)) if self.cost else cfg

    @property
    def chooses_block_size(self) -> bool:
        return any(k == "engine.block_size" for k, _ in self.cost)


@dataclass(frozen=True)
class Cell:
    """One point of the grid: every router runs it once per seed."""

    name: str
    workload: str
    setup: str
    engines: int
    time_scale: float = 1.0  # arrival times multiplied by this (0.5: twice the load)
    slow_workers: tuple[tuple[int, float], ...] = ()
    join_at_s: tuple[tuple[int, float], ...] = ()
    max_num_seqs: tuple[tuple[int, int], ...] = ()  # engine -> its sequence slots
    # hot-prefix replication's knobs (`quillcache.sim.replicate`); None: off
    replicate: tuple[tuple[str, Any], ...] | None = None
    # session retention's knobs (`quillcache.sim.retain`); None: off
    retain: tuple[tuple[str, Any], ...] | None = None
    # every request's SLO and whether the admission stage holds it (`SimConfig.slo`):
    # (("admission", bool), ("tbt_s", x | None), ("ttft_s", x | None)); None: none
    slo: tuple[tuple[str, Any], ...] | None = None

    def key(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "workload": self.workload,
            "setup": self.setup,
            "engines": self.engines,
            "time_scale": self.time_scale,
        }
        if self.slow_workers:
            out["slow_workers"] = {str(w): f for w, f in self.slow_workers}
        if self.join_at_s:
            out["join_at_s"] = {str(w): t for w, t in self.join_at_s}
        if self.max_num_seqs:
            out["max_num_seqs"] = {str(w): n for w, n in self.max_num_seqs}
        if self.replicate is not None:
            out["replicate"] = dict(self.replicate)
        if self.retain is not None:
            out["retain"] = dict(self.retain)
        if self.slo is not None:
            out["slo"] = dict(self.slo)
        return out


@dataclass
class Grid:
    name: str
    description: str
    routers: list[str]
    seeds: list[int]
    workloads: dict[str, WorkloadSpec]
    setups: dict[str, SetupSpec]
    cells: list[Cell] = field(default_factory=list)


# --- parsing ---------------------------------------------------------------------------


class _Source:
    """The grid's text, for error messages that name the line of a key."""

    def __init__(self, origin: str, text: str) -> None:
        self.origin = origin
        self.lines = text.splitlines()

    def error(self, path: str, message: str) -> ConfigError:
        line = self.line_of(path)
        where = f"{self.origin}, line {line}" if line else self.origin
        return ConfigError(f"grid {where}: {path}: {message}")

    def line_of(self, path: str) -> int | None:
        """The line where the dotted key `path` is written (best effort: the first line
        assigning its last part after the header of the table holding it)."""
        parts = [p for p in re.split(r"\.|\[\d+\]", path) if p]
        if not parts:
            return None
        tables = parts[:-1]
        start = 0
        if tables:
            # a header [a.b] / [[a]] naming the table (or a parent), else from the top
            for i, raw in enumerate(self.lines):
                header = raw.strip().strip("[]").strip()
                if raw.strip().startswith("[") and header in (
                    ".".join(tables),
                    ".".join(tables[:1]),
                ):
                    start = i
                    index = re.search(r"\[(\d+)\]", path)
                    if index and raw.strip().startswith("[["):
                        n = int(index.group(1))
                        hits = [
                            j
                            for j, r in enumerate(self.lines)
                            if r.strip().startswith("[[")
                            and r.strip().strip("[]").strip() == header
                        ]
                        if n < len(hits):
                            start = hits[n]
                    break
        # the key itself, else the nearest enclosing key written on a line of its own
        # (an inline table's entries share their key's line)
        for part in reversed(parts):
            key = re.compile(
                rf"^\s*\"?{re.escape(part)}\"?\s*=|^\s*\[+\s*[\w.\-]*{re.escape(part)}\s*\]+"
            )
            for i in range(start, len(self.lines)):
                if key.search(self.lines[i]):
                    return i + 1
        return start + 1 if tables else None


def load_grid(source: str) -> Grid:
    """A grid from a TOML file, or a shipped grid by name (`quick`, `full`, ...)."""
    from quillcache.sim.grids import NAMED

    if source in NAMED:
        return parse_grid(NAMED[source], origin=source, name=source)
    p = Path(source)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(
            f"cannot read grid {source!r} ({exc.strerror or exc}); a grid is a TOML file "
            f"or one of the shipped grids: {', '.join(NAMED)}"
        ) from None
    return parse_grid(text, origin=str(p), name=p.stem, base_dir=p.parent)


def parse_grid(
    text: str, *, origin: str = "grid", name: str = "grid", base_dir: Path | None = None
) -> Grid:
    src = _Source(origin, text)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"grid {origin} is not valid TOML: {exc}") from None
    _known(
        src, "", data, {"description", "routers", "seeds", "axes", "workloads", "setups", "cells"}
    )
    description = data.get("description", "")
    if not isinstance(description, str):
        raise src.error("description", "must be a string")
    routers = _routers(src, data.get("routers", "all"))
    seeds = _seeds(src, data.get("seeds", 3))
    workloads = dict(BUILTIN_WORKLOADS)
    for wname, table in _table(src, "workloads", data.get("workloads", {})).items():
        workloads[wname] = _workload(src, f"workloads.{wname}", wname, table)
    setups = {n: SetupSpec(n, n) for n in SETUPS}
    for sname, table in _table(src, "setups", data.get("setups", {})).items():
        setups[sname] = _setup(src, f"setups.{sname}", sname, table)
    cells: list[Cell] = []
    if "axes" in data:
        cells += _axes(src, _table(src, "axes", data["axes"]), workloads, setups)
    raw_cells = data.get("cells", [])
    if not isinstance(raw_cells, list):
        raise src.error("cells", "must be an array of tables ([[cells]])")
    for i, table in enumerate(raw_cells):
        cells.append(_cell(src, f"cells[{i}]", table, workloads, setups))
    if not cells:
        raise ConfigError(f"grid {origin}: no cells: give [axes] or [[cells]]")
    names = [c.name for c in cells]
    for n in names:
        if names.count(n) > 1:
            raise ConfigError(f"grid {origin}: two cells are named {n!r}")
    n_axes = len(cells) - len(raw_cells)
    for i, c in enumerate(cells):
        where = "axes.setups" if i < n_axes else f"cells[{i - n_axes}].setup"
        _check_block_size(src, where, c, workloads[c.workload], setups[c.setup])
    used = {c.workload for c in cells}
    for wname in sorted(used):
        spec = workloads[wname]
        if spec.trace is not None:
            workloads[wname] = _resolve_trace(src, wname, spec, base_dir)
    return Grid(
        name,
        description,
        routers,
        seeds,
        {w: workloads[w] for w in sorted(used)},
        {s: setups[s] for s in sorted({c.setup for c in cells})},
        cells,
    )


def _check_block_size(
    src: _Source, where: str, cell: Cell, workload: WorkloadSpec, setup: SetupSpec
) -> None:
    """An engine block size the setup sets must divide the workload's (before any run)."""
    if not setup.chooses_block_size:
        return
    engine_bs = setup.config().engine.block_size
    if workload.trace is not None:
        coarse = workload.block_size
    else:
        assert workload.generator is not None
        default = inspect.signature(GENERATORS[workload.generator]).parameters["block_size"].default
        coarse = dict(workload.params).get("block_size", default)
    if coarse % engine_bs:
        raise src.error(
            where,
            f"cell {cell.name!r}: setup {setup.name!r} sets engine.block_size {engine_bs}, "
            f"which does not divide workload {workload.name!r}'s block size {coarse}",
        )


def _known(src: _Source, prefix: str, table: dict[str, Any], allowed: set[str]) -> None:
    for key in table:
        if key not in allowed:
            raise src.error(
                f"{prefix}{key}", f"unknown key; known here: {', '.join(sorted(allowed))}"
            )


def _table(src: _Source, path: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise src.error(path, f"must be a table, got {type(value).__name__}")
    return value


def _routers(src: _Source, value: Any) -> list[str]:
    from quillcache.routing import BUILTIN_ORDER, available_routers

    if value == "all":
        return list(BUILTIN_ORDER)
    if not isinstance(value, list) or not value or not all(isinstance(r, str) for r in value):
        raise src.error("routers", 'must be "all" or a non-empty list of router names')
    known = set(available_routers())
    for r in value:
        if r not in known:
            raise src.error("routers", f"unknown router {r!r}; known: {', '.join(sorted(known))}")
    if len(set(value)) != len(value):
        raise src.error("routers", "a router is listed twice")
    return list(value)


def _seeds(src: _Source, value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise src.error("seeds", f"must be >= 1, got {value}")
        return list(range(value))
    if (
        isinstance(value, list)
        and value
        and all(isinstance(s, int) and not isinstance(s, bool) for s in value)
    ):
        if len(set(value)) != len(value):
            raise src.error("seeds", "a seed is listed twice")
        if min(value) < 0 or max(value) >= 2**64:
            raise src.error("seeds", "seeds must be whole numbers from 0 to 2**64 - 1")
        return list(value)
    raise src.error("seeds", "must be a count (3: seeds 0, 1, 2) or a list of whole numbers")


def _workload(src: _Source, path: str, name: str, table: Any) -> WorkloadSpec:
    t = _table(src, path, table)
    if ("trace" in t) == ("generator" in t):
        raise src.error(path, 'give exactly one of trace = "FILE.jsonl" or generator = "NAME"')
    if "trace" in t:
        _known(src, f"{path}.", t, {"trace", "block_size", "limit"})
        trace, bs, limit = t["trace"], t.get("block_size", 512), t.get("limit")
        if not isinstance(trace, str):
            raise src.error(f"{path}.trace", "must be a file name")
        if not isinstance(bs, int) or bs <= 0:
            raise src.error(f"{path}.block_size", f"must be a positive whole number, got {bs!r}")
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise src.error(f"{path}.limit", f"must be a positive whole number, got {limit!r}")
        return WorkloadSpec(name, trace=trace, block_size=bs, limit=limit)
    gen = t["generator"]
    if not isinstance(gen, str) or gen not in GENERATORS:
        raise src.error(
            f"{path}.generator", f"unknown generator {gen!r}; known: {', '.join(GENERATORS)}"
        )
    accepted = set(inspect.signature(GENERATORS[gen]).parameters) - {"seed", "model"}
    params = {k: v for k, v in t.items() if k != "generator"}
    for k, v in params.items():
        if k not in accepted:
            raise src.error(
                f"{path}.{k}", f"not a parameter of {gen}; known: {', '.join(sorted(accepted))}"
            )
        if isinstance(v, (dict, list)):
            raise src.error(f"{path}.{k}", "must be a number or a string")
    try:
        checked_params(gen, params)
    except ConfigError as exc:
        raise src.error(path, f"{gen} refuses these parameters: {exc}") from None
    base = dict(BUILTIN_WORKLOADS[gen].params) if gen in BUILTIN_WORKLOADS else {}
    spec = WorkloadSpec(name, gen, tuple({**base, **params}.items()))
    try:
        _generate(spec, seed=0)  # bad values are said here, not in a worker process
    except (ConfigError, TypeError, ValueError) as exc:
        raise src.error(path, f"{gen} refuses these parameters: {exc}") from None
    return spec


def _flat(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(f"{prefix}.{k}" if prefix else k, v)
    else:
        yield prefix, value


def _setup(src: _Source, path: str, name: str, table: Any) -> SetupSpec:
    t = _table(src, path, table)
    _known(src, f"{path}.", t, {"base", "cost"})
    base = t.get("base")
    if not isinstance(base, str) or base not in SETUPS:
        raise src.error(f"{path}.base", f"unknown setup {base!r}; known: {', '.join(SETUPS)}")
    cost = tuple(_flat("", _table(src, f"{path}.cost", t.get("cost", {}))))
    spec = SetupSpec(name, base, cost)
    try:
        spec.config()
    except ConfigError as exc:
        raise src.error(f"{path}.cost", str(exc)) from None
    return spec


def _positive_ints(src: _Source, path: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise src.error(path, "must be a non-empty list")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise src.error(path, f"{v!r} is not a positive whole number")
    return list(value)


def _scale(src: _Source, path: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or math.isinf(v):
        raise src.error(path, f"{v!r} is not a positive number")
    return float(v)


def _names(src: _Source, path: str, value: Any, known: dict[str, Any], what: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise src.error(path, f"must be a non-empty list of {what} names")
    for v in value:
        if not isinstance(v, str) or v not in known:
            raise src.error(path, f"unknown {what} {v!r}; known: {', '.join(sorted(known))}")
    return list(value)


def _axes(
    src: _Source,
    t: dict[str, Any],
    workloads: dict[str, WorkloadSpec],
    setups: dict[str, SetupSpec],
) -> list[Cell]:
    _known(src, "axes.", t, {"workloads", "setups", "engines", "time_scale"})
    for k in ("workloads", "setups", "engines"):
        if k not in t:
            raise src.error(f"axes.{k}", "missing")
    ws = _names(src, "axes.workloads", t["workloads"], workloads, "workload")
    ss = _names(src, "axes.setups", t["setups"], setups, "setup")
    es = _positive_ints(src, "axes.engines", t["engines"])
    raw_scales = t.get("time_scale", [1.0])
    if not isinstance(raw_scales, list) or not raw_scales:
        raise src.error("axes.time_scale", "must be a non-empty list of positive numbers")
    scales = [_scale(src, "axes.time_scale", v) for v in raw_scales]
    return [
        Cell(f"{w} / {s} / {e} engines / time x{ts:g}", w, s, e, ts)
        for w in ws
        for s in ss
        for e in es
        for ts in scales
    ]


#: How many times slower than the setup's GPU an engine may be made (`slow_workers`).
MAX_SLOW_FACTOR = 1000.0


def _worker_table(
    src: _Source, path: str, value: Any, engines: int, what: str
) -> tuple[tuple[int, float], ...]:
    t = _table(src, path, value)
    out = []
    for k, v in t.items():
        try:
            w = int(k)
        except ValueError:
            raise src.error(f"{path}.{k}", "the key must be a worker number") from None
        if not 0 <= w < engines:
            raise src.error(f"{path}.{k}", f"worker {w} is not one of the cell's {engines} engines")
        if (
            isinstance(v, bool)
            or not isinstance(v, int if what == "slots" else (int, float))
            or not (v > 0 if what in ("factor", "slots") else v >= 0)
            or not math.isfinite(v)
            or (what == "factor" and v > MAX_SLOW_FACTOR)
        ):
            limit = f" (at most {MAX_SLOW_FACTOR:g})" if what == "factor" else ""
            raise src.error(f"{path}.{k}", f"{v!r} is not a valid {what}{limit}")
        out.append((w, float(v)))
    return tuple(sorted(out))


def _cell(
    src: _Source,
    path: str,
    table: Any,
    workloads: dict[str, WorkloadSpec],
    setups: dict[str, SetupSpec],
) -> Cell:
    t = _table(src, path, table)
    _known(
        src,
        f"{path}.",
        t,
        {
            "name",
            "workload",
            "setup",
            "engines",
            "time_scale",
            "slow_workers",
            "join_at_s",
            "max_num_seqs",
            "replicate",
            "retain",
            "slo",
        },
    )
    for k in ("name", "workload", "setup", "engines"):
        if k not in t:
            raise src.error(f"{path}.{k}", "missing")
    if not isinstance(t["name"], str) or not t["name"]:
        raise src.error(f"{path}.name", "must be a non-empty string")
    if not isinstance(t["workload"], str) or t["workload"] not in workloads:
        raise src.error(
            f"{path}.workload",
            f"unknown workload {t['workload']!r}; known: {', '.join(sorted(workloads))}",
        )
    if not isinstance(t["setup"], str) or t["setup"] not in setups:
        raise src.error(
            f"{path}.setup", f"unknown setup {t['setup']!r}; known: {', '.join(sorted(setups))}"
        )
    engines = _positive_ints(src, f"{path}.engines", [t["engines"]])[0]
    scale = _scale(src, f"{path}.time_scale", t.get("time_scale", 1.0))
    slow = _worker_table(src, f"{path}.slow_workers", t.get("slow_workers", {}), engines, "factor")
    join = _worker_table(src, f"{path}.join_at_s", t.get("join_at_s", {}), engines, "time")
    if len(join) >= engines:
        raise src.error(f"{path}.join_at_s", "at least one engine must be there from the start")
    seqs = _worker_table(src, f"{path}.max_num_seqs", t.get("max_num_seqs", {}), engines, "slots")
    from quillcache.sim.replicate import ReplicateSettings
    from quillcache.sim.retain import RetainSettings

    replicate = _policy(src, path, t, "replicate", ReplicateSettings.parse)
    retain = _policy(src, path, t, "retain", RetainSettings.parse)
    slo = _cell_slo(src, f"{path}.slo", t["slo"]) if "slo" in t else None
    return Cell(
        t["name"],
        t["workload"],
        t["setup"],
        engines,
        scale,
        slow,
        join,
        tuple((w, int(n)) for w, n in seqs),
        replicate,
        retain,
        slo,
    )


def _policy(
    src: _Source, path: str, t: dict[str, Any], key: str, parse: Callable[[dict[str, Any]], Any]
) -> tuple[tuple[str, Any], ...] | None:
    """A cell's policy table (`replicate`, `retain`), checked by its settings' `parse`,
    as sorted (knob, value) pairs; None when the cell has none."""
    if key not in t:
        return None
    opts = _table(src, f"{path}.{key}", t[key])
    try:
        parse(opts)
    except ConfigError as exc:
        raise src.error(f"{path}.{key}", str(exc)) from None
    return tuple(sorted(opts.items()))


def _cell_slo(src: _Source, path: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """A cell's `slo = { ttft_s = 2.0, tbt_s = 0.1, admission = true }`: at least one
    bound, each a positive number of seconds; `admission` (default true) false only
    reads the SLO in the report."""
    t = _table(src, path, value)
    _known(src, f"{path}.", t, {"ttft_s", "tbt_s", "admission"})
    bounds: dict[str, float | None] = {}
    for k in ("ttft_s", "tbt_s"):
        v = t.get(k)
        ok = v is None or (
            not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < math.inf
        )
        if not ok:
            raise src.error(f"{path}.{k}", f"must be a positive number of seconds, got {v!r}")
        bounds[k] = None if v is None else float(v)
    if bounds["ttft_s"] is None and bounds["tbt_s"] is None:
        raise src.error(path, "needs ttft_s or tbt_s")
    admission = t.get("admission", True)
    if not isinstance(admission, bool):
        raise src.error(f"{path}.admission", "must be true or false")
    return (("admission", admission), ("tbt_s", bounds["tbt_s"]), ("ttft_s", bounds["ttft_s"]))


def trace_dirs(base_dir: Path | None) -> list[Path]:
    """Where a grid's relative trace name is looked for, in order."""
    dirs = [] if base_dir is None else [base_dir]
    env = os.environ.get(TRACE_DIR_ENV)
    if env:
        dirs.append(Path(env))
    dirs += [Path.cwd(), Path.cwd().parent / "shared" / "traces"]
    return list(dict.fromkeys(d.resolve() for d in dirs))


def _resolve_trace(
    src: _Source, wname: str, spec: WorkloadSpec, base_dir: Path | None
) -> WorkloadSpec:
    assert spec.trace is not None
    p = Path(spec.trace).expanduser()
    candidates = [p] if p.is_absolute() else [d / p for d in trace_dirs(base_dir)]
    for c in candidates:
        if c.is_file():
            return WorkloadSpec(
                spec.name,
                trace=spec.trace,
                trace_path=str(c),
                block_size=spec.block_size,
                limit=spec.limit,
            )
    raise src.error(
        f"workloads.{wname}.trace",
        f"trace {spec.trace!r} not found (looked in: "
        f"{', '.join(str(c.parent) for c in candidates)}); set {TRACE_DIR_ENV} to its directory",
    )


# --- running ---------------------------------------------------------------------------


def _generate(spec: WorkloadSpec, *, seed: int) -> Workload:
    assert spec.generator is not None
    return GENERATORS[spec.generator](**dict(spec.params), seed=seed)


Task = tuple[int, int, str]  # cell index, seed, router

# The parent fills this before forking; workers read it instead of unpickling a grid.
_STATE: dict[str, Any] = {}


def _workload_for(cell: Cell, seed: int) -> tuple[Workload, CostModel]:
    """The cell's workload for `seed`, on its setup's engines (one entry cached: tasks
    come cell by cell, seed by seed)."""
    key = (cell.workload, cell.setup, cell.time_scale, seed)
    cache = _STATE.setdefault("cache", {})
    if key in cache:
        return cache[key]
    grid: Grid = _STATE["grid"]
    spec = grid.workloads[cell.workload]
    wl = _trace(spec) if spec.trace_path is not None else _generate(spec, seed=seed)
    wl = wl.scaled(cell.time_scale)
    setup = grid.setups[cell.setup]
    config = setup.config()
    if setup.chooses_block_size:
        wl = wl.with_engine_blocks(config.engine.block_size)
    cost = CostModel(config.with_overrides({"engine.block_size": wl.block_size}))
    cache.clear()
    cache[key] = (wl, cost)
    return wl, cost


def _trace(spec: WorkloadSpec) -> Workload:
    from quillcache.sim.trace import load_trace

    traces = _STATE.setdefault("traces", {})
    key = (spec.trace_path, spec.block_size, spec.limit)
    if key not in traces:
        traces[key] = load_trace(
            spec.trace_path or "", block_size=spec.block_size, limit=spec.limit
        )
    return traces[key]


# What a run keeps: deterministic for its seed (no wall times).
_KEPT = (
    "ttft_mean_s",
    "ttft_p99_s",
    "e2e_mean_s",
    "block_hit_rate",
    "rejected",
    "worker_share",
    "kv_exceeds_gpu",
    "capacity_blocks",
    "kv_optimal_share",
    "regret_tokens_per_request",
)
#: Kept when the cell runs a policy (`Cell.replicate`, `Cell.retain`, `Cell.slo`) or its
#: workload has follow-ups (closed loop).
_KEPT_POLICY = (
    "replications",
    "replication_prefill_tokens",
    "replication_prefill_pct",
    "retention_touches",
    "retention_prefetches",
    "retention_prefill_pct",
    "followup_reuse_share",
    "followup_ttft_mean_s",
    "slo_met_share",
    "slo_goodput_share",
)


def seed_free(grid: Grid, ci: int) -> bool:
    """Whether a cell's workload is the same for every seed (a trace; a generator's
    depends on its seed): its runs whose router never used its seed are run once."""
    return grid.workloads[grid.cells[ci].workload].trace_path is not None


def run_task(task: Task) -> tuple[dict[str, Any], float]:
    """One (cell, seed, router) run: its kept metrics and the CPU seconds it took."""
    kept, cpu_s, _ = _run_one(task)
    return kept, cpu_s


def _run_one(task: Task) -> tuple[dict[str, Any], float, bool]:
    """`run_task`, and whether the run used its seed (`Router.seed_used`)."""
    from quillcache.routing import create_router
    from quillcache.sim.runner import SimConfig, run

    cpu0 = time.process_time()
    ci, seed, router = task
    cell: Cell = _STATE["grid"].cells[ci]
    try:
        wl, cost = _workload_for(cell, seed)
    except QuillCacheError as exc:
        raise ConfigError(f"cell {cell.name!r}, seed {seed}: {exc}") from None
    replicate = None
    if cell.replicate is not None:
        from quillcache.sim.replicate import ReplicateSettings

        replicate = ReplicateSettings.parse(dict(cell.replicate))
    retain = None
    if cell.retain is not None:
        from quillcache.sim.retain import RetainSettings

        retain = RetainSettings.parse(dict(cell.retain))
    slo, admission = None, True
    if cell.slo is not None:
        from quillcache.routing import SLO

        spec = dict(cell.slo)
        slo, admission = SLO(ttft_s=spec["ttft_s"], tbt_s=spec["tbt_s"]), spec["admission"]
    config = SimConfig(
        workers=cell.engines,
        seed=seed,
        slow_workers=dict(cell.slow_workers),
        join_at_s=dict(cell.join_at_s),
        max_num_seqs=dict(cell.max_num_seqs),
        replicate=replicate,
        retain=retain,
        slo=slo,
        admission=admission,
    )
    try:
        router_obj = create_router(router, seed=seed)
        summary = run(wl, router_obj, "native", config, cost).summary()
    except QuillCacheError as exc:  # said with the run it belongs to, in any process
        raise ConfigError(f"cell {cell.name!r}, seed {seed}, router {router}: {exc}") from None
    kept = {"router": router, "seed": seed, **{k: summary[k] for k in _KEPT}}
    kept.update({k: summary[k] for k in _KEPT_POLICY if k in summary})
    return kept, time.process_time() - cpu0, router_obj.seed_used


#: What a task gives back wherever it ran: its kept metrics (None when it failed), the
#: CPU seconds it took, and its error (None when it ran).
TaskResult = tuple[dict[str, Any] | None, float, str | None]


def run_task_guarded(task: Task) -> TaskResult:
    """`run_task`, a failure returned as its message instead of ending the grid."""
    result, _ = _guarded(task)
    return result


def _guarded(task: Task) -> tuple[TaskResult, bool]:
    cpu0 = time.process_time()
    try:
        kept, task_cpu, seed_used = _run_one(task)
    except QuillCacheError as exc:
        return (None, time.process_time() - cpu0, str(exc)), True
    except Exception as exc:  # a bug in one run: reported with its cell, not fatal
        ci, seed, router = task
        name = _STATE["grid"].cells[ci].name
        return (
            None,
            time.process_time() - cpu0,
            (f"cell {name!r}, seed {seed}, router {router}: {type(exc).__name__}: {exc}"),
        ), True
    return (kept, task_cpu, None), seed_used


#: Tasks run together, with their indices in the grid's task order: one task, or a
#: seed-free cell's router over several seeds (`units_of`).
Unit = list[tuple[int, Task]]


def run_unit(unit: Unit) -> list[tuple[int, TaskResult]]:
    """A unit's results. A unit of several seeds runs its first; when that run did not
    use its seed, the others are that run (`"same_run_as_seed"` names it; no CPU time),
    else each runs."""
    (i0, first), rest = unit[0], unit[1:]
    result, seed_used = _guarded(first)
    out = [(i0, result)]
    kept = result[0]
    for i, task in rest:
        if kept is not None and not seed_used:
            copy = {**kept, "seed": task[1], "same_run_as_seed": first[1]}
            out.append((i, (copy, 0.0, None)))
        else:
            out.append((i, run_task_guarded(task)))
    return out


def units_of(grid: Grid, todo: list[tuple[int, Task]]) -> list[Unit]:
    """The tasks to run, grouped: a seed-free cell's (`seed_free`) tasks of one router
    form one unit, in seed order; every other task is a unit of its own. The units come
    in the order of their first task."""
    units: list[Unit] = []
    grouped: dict[tuple[int, str], Unit] = {}
    for i, task in todo:
        ci, _, router = task
        if seed_free(grid, ci):
            unit = grouped.get((ci, router))
            if unit is not None:
                unit.append((i, task))
                continue
            grouped[(ci, router)] = unit = []
            unit.append((i, task))
            units.append(unit)
        else:
            units.append([(i, task)])
    return units


def tasks_of(grid: Grid) -> list[Task]:
    return [
        (ci, seed, router)
        for ci in range(len(grid.cells))
        for seed in grid.seeds
        for router in grid.routers
    ]


@dataclass
class Outcome:
    """The runs of a grid, in task order (None for a failed one), and what they cost."""

    runs: list[dict[str, Any] | None]
    task_cpu_s: list[float]  # per task, in task order
    wall_s: float
    jobs: int
    errors: list[str | None] = field(default_factory=list)  # per task, in task order
    where: str = "local"  # "local", or the Ray cluster's address
    resumed: int = 0  # runs taken from a checkpoint, not run by this call (`wall_s`)

    @property
    def failures(self) -> list[str]:
        return [e for e in self.errors if e is not None]

    @property
    def cpu_s(self) -> float:
        return sum(self.task_cpu_s)

    def cell_cpu_s(self, grid: Grid) -> list[float]:
        per_cell = len(grid.seeds) * len(grid.routers)
        cpu = self.task_cpu_s
        return [sum(cpu[i : i + per_cell]) for i in range(0, len(cpu), per_cell)]


def execute(
    grid: Grid,
    *,
    jobs: int = 1,
    progress: Callable[[int, int], None] | None = None,
    ray: str | None = None,
    checkpoint: Checkpoint | None = None,
) -> Outcome:
    """Every task of the grid, in `jobs` forked processes (1: in this one), or on the
    Ray cluster `ray` names (`quillcache.sim.matrix_ray.RAY_HELP`). With a
    `checkpoint`, the runs it holds are not run again and each run is kept there as it
    finishes (in whatever order runs finish; the outcome is in task order)."""
    import multiprocessing as mp

    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1 for a matrix, got {jobs}")
    tasks = tasks_of(grid)
    results: list[TaskResult | None] = [None] * len(tasks)
    resumed = 0
    if checkpoint is not None:
        for i, result in checkpoint.done.items():
            results[i] = result
        resumed = checkpoint.resumed
    todo = [(i, t) for i, t in enumerate(tasks) if results[i] is None]
    units = units_of(grid, todo)
    finished = len(tasks) - len(todo)

    def finish(i: int, result: TaskResult) -> None:
        nonlocal finished
        results[i] = result
        if checkpoint is not None:
            checkpoint.record(tasks[i], result)
        finished += 1
        if progress is not None:
            progress(finished, len(tasks))

    _STATE.clear()
    _STATE["grid"] = grid
    try:
        for spec in grid.workloads.values():  # read once here; workers inherit it
            if spec.trace_path is not None:
                _trace(spec)
        t0 = time.perf_counter()
        if ray is not None:
            from quillcache.sim.matrix_ray import run_on_ray

            where, used = run_on_ray(dict(_STATE), units, ray, jobs, finish)
        else:
            jobs = min(jobs, max(len(units), 1))
            parallel = jobs > 1 and "fork" in mp.get_all_start_methods()
            if parallel:
                with mp.get_context("fork").Pool(jobs) as pool:
                    for ran in pool.imap_unordered(run_unit, units):
                        for i, result in ran:
                            finish(i, result)
            else:
                for unit in units:
                    for i, result in run_unit(unit):
                        finish(i, result)
            where, used = "local", jobs if parallel else 1
        done = [r for r in results if r is not None]
        assert len(done) == len(tasks), "every task has a result"
        return _outcome(done, time.perf_counter() - t0, used, where, resumed)
    finally:
        _STATE.clear()


def _outcome(
    results: list[TaskResult], wall_s: float, jobs: int, where: str, resumed: int = 0
) -> Outcome:
    return Outcome(
        runs=[kept for kept, _, _ in results],
        task_cpu_s=[cpu for _, cpu, _ in results],
        wall_s=wall_s,
        jobs=jobs,
        errors=[err for _, _, err in results],
        where=where,
        resumed=resumed,
    )


def install_state(state: dict[str, Any]) -> None:
    """Give this process the grid and traces a remote worker runs tasks of."""
    if _STATE.get("grid") is not state["grid"]:
        _STATE.clear()
        _STATE.update(state)


# --- judging ---------------------------------------------------------------------------


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None or x != x else round(x, nd)


def summarize(
    grid: Grid, runs: list[dict[str, Any] | None], errors: list[str | None] | None = None
) -> dict[str, Any]:
    """The deterministic results: per cell, per router the seeds' mean and spread of
    mean and p99 TTFT, the winners, and the verdict on QuillCache's own policy. A cell
    with a failed run is not judged: it lists its runs' errors instead."""
    per_cell = len(grid.seeds) * len(grid.routers)
    cells = []
    for ci, cell in enumerate(grid.cells):
        span = slice(ci * per_cell, (ci + 1) * per_cell)
        cell_errors = [e for e in (errors or [])[span] if e is not None]
        if cell_errors or any(r is None for r in runs[span]):
            failed = {"winner": None, "verdict": "failed"}
            cells.append(
                {
                    **cell.key(),
                    "failed": cell_errors or ["a run gave no result"],
                    "routers": {},
                    "mean": failed,
                    "p99": dict(failed),
                    "runs": [r for r in runs[span] if r is not None],
                }
            )
            continue
        chunk = [r for r in runs[span] if r is not None]
        routers: dict[str, dict[str, Any]] = {}
        for router in grid.routers:
            mine = [r for r in chunk if r["router"] == router]
            row: dict[str, Any] = {}
            for metric in ("ttft_mean_s", "ttft_p99_s"):
                vals = [r[metric] for r in mine if r[metric] is not None]
                row[metric] = _r(_mean(vals)) if vals else None
                row[metric.replace("_s", "_spread_s")] = _r(max(vals) - min(vals)) if vals else None
            hits = [r["block_hit_rate"] for r in mine]
            row["block_hit_rate"] = _r(_mean(hits))
            row["rejected"] = sum(r["rejected"] for r in mine)
            row["max_worker_share"] = _r(_mean([max(r["worker_share"]) for r in mine]), 4)
            # regret (docs/simulator.md): prefill another routable engine held, per request
            row["kv_optimal_share"] = _r(_mean([r["kv_optimal_share"] for r in mine]), 4)
            row["regret_tokens_per_request"] = _r(
                _mean([r["regret_tokens_per_request"] for r in mine]), 2
            )
            if cell.replicate is not None:  # the policy's cost beside its benefit
                row["replications"] = sum(r["replications"] for r in mine)
                row["replication_prefill_pct"] = _r(
                    _mean([r["replication_prefill_pct"] for r in mine]), 3
                )
            if cell.retain is not None:
                row["retention_touches"] = sum(
                    r["retention_touches"] + r["retention_prefetches"] for r in mine
                )
                row["retention_prefill_pct"] = _r(
                    _mean([r["retention_prefill_pct"] for r in mine]), 3
                )
            for metric in (
                "followup_reuse_share",
                "followup_ttft_mean_s",
                "slo_met_share",
                "slo_goodput_share",
            ):
                vals = [r[metric] for r in mine if r.get(metric) is not None]
                if vals:
                    row[metric] = _r(_mean(vals), 4)
            routers[router] = row
        cells.append(
            {
                **cell.key(),
                "capacity_blocks": chunk[0]["capacity_blocks"],
                "kv_exceeds_gpu": chunk[0]["kv_exceeds_gpu"],
                "routers": routers,
                "mean": _verdict(routers, "ttft_mean_s"),
                "p99": _verdict(routers, "ttft_p99_s"),
                "runs": chunk,
            }
        )
    return {"cells": cells, "totals": _totals(cells)}


def _verdict(routers: dict[str, dict[str, Any]], metric: str) -> dict[str, Any]:
    """The winner on `metric` (lowest mean over seeds; a router that rejected requests
    is not eligible: its TTFTs leave them out), and how QuillCache's own policy does:
    `best`, `within_spread` (within the winner's max - min over seeds) or `loses`."""
    spread_key = metric.replace("_s", "_spread_s")
    eligible = {n: r for n, r in routers.items() if r[metric] is not None and r["rejected"] == 0}
    if not eligible:
        return {"winner": None, "own": None, "verdict": "no eligible router"}
    winner = min(eligible, key=lambda n: eligible[n][metric])
    best = eligible[winner][metric]
    out: dict[str, Any] = {"winner": winner, "best_s": best}
    own = routers.get(OWN_ROUTER)
    if own is None or own[metric] is None:
        out["verdict"] = "not run" if own is None else "no value"
        return out
    mine = own[metric]
    out["own_s"] = mine
    out["own_vs_best_pct"] = _r((mine / best - 1.0) * 100.0, 2) if best > 0 else None
    if own["rejected"]:
        out["verdict"] = "rejects"
    elif winner == OWN_ROUTER:
        out["verdict"] = "best"
    elif mine <= best + eligible[winner][spread_key]:
        out["verdict"] = "within_spread"
    else:
        out["verdict"] = "loses"
    return out


def _totals(cells: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for metric in ("mean", "p99"):
        counts: dict[str, int] = {}
        for c in cells:
            v = c[metric]["verdict"]
            counts[v] = counts.get(v, 0) + 1
        out[metric] = dict(sorted(counts.items()))
    return out


def results_json(grid: Grid, outcome: Outcome) -> dict[str, Any]:
    """Everything deterministic about a matrix run (no times: those are in the page)."""
    return {
        "meta": {
            "grid": grid.name,
            "description": grid.description,
            "routers": grid.routers,
            "seeds": grid.seeds,
            "own_router": OWN_ROUTER,
            "workloads": {n: w.describe() for n, w in grid.workloads.items()},
            "setups": {n: s.config().model_dump() for n, s in grid.setups.items()},
        },
        **summarize(grid, outcome.runs, outcome.errors),
    }
