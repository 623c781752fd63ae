"""Trace replay: Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`,
`hash_ids`), with chained ids (Mooncake) or per-block ids (each id names a block's
content alone). The trace declares its block size (Mooncake: 512 tokens).

Blocks carry no tokens in such traces; `requests.synthetic_block_tokens` gives each id
deterministic tokens so that content keys and BlockStored token_ids are real.

Rows may carry Dynamo's agentic fields (`request_id`, `wait_for`, `branches`, `delay`,
`tool_wait_ms`, `prefix_reset`, `session_id`; `quillcache.sim.agentic`): a row that waits
for others is then sent closed loop, when they have finished plus its wait.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from quillcache.errors import ConfigError
from quillcache.sim.agentic import Dependencies, agentic_row
from quillcache.sim.requests import KeyChainer, SimRequest, attach_layouts, make_request
from quillcache.sim.workload import DEFAULT_MODEL, Workload, sim_namespace

MOONCAKE_BLOCK_SIZE = 512


def _lines(fh: BinaryIO, path: Path) -> Iterator[tuple[int, str]]:
    """The file's lines, numbered from 1; ConfigError for a line that is not UTF-8."""
    for lineno, raw in enumerate(fh, 1):
        try:
            yield lineno, raw.decode()
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"{path}:{lineno}: not UTF-8 text (a JSONL trace is): {exc}"
            ) from None


def _block_id(h: object) -> int:
    """A trace's block id: an integer of 64 bits, unsigned (what the simulator keys)."""
    if not isinstance(h, int) or isinstance(h, bool):
        raise TypeError(f"hash_ids must be integers, got {h!r}")
    if not 0 <= h < 2**64:
        raise ValueError(f"hash_ids must be in [0, 2**64), got {h}")
    return h


def load_trace(
    path: str | Path,
    *,
    block_size: int = MOONCAKE_BLOCK_SIZE,
    chained: bool = True,
    limit: int | None = None,
    model: str = DEFAULT_MODEL,
) -> Workload:
    """Read a Mooncake-format JSONL trace into a workload.

    `chained=True`: equal ids at a position mean equal prefixes (Mooncake); the
    content keys then repeat exactly where the ids do. `chained=False`: an id names one
    block's content; keys still chain, so a block is only reused under the same prefix.
    Both produce the same keys for a chained trace; the flag documents intent and
    checks the declared property (a chained trace never reuses an id under another parent).
    """
    p = Path(path)
    try:
        fh = p.open("rb")
    except OSError as exc:
        raise ConfigError(f"cannot read trace {p}: {exc}") from None
    ns = sim_namespace(block_size, model)
    chainer = KeyChainer(ns, block_size, chained=chained)
    parent_of: dict[int, int] = {}
    reqs: list[SimRequest] = []
    deps = Dependencies(p)
    truncated = False
    with fh:
        for lineno, line in _lines(fh, p):
            if limit is not None and len(reqs) >= limit:
                truncated = True
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TypeError(f"a JSON object, got {type(rec).__name__}")
                ts = None if "timestamp" not in rec else float(rec["timestamp"]) / 1000.0
                if ts is not None and not math.isfinite(ts):
                    raise ValueError(f"timestamp {rec['timestamp']} is not a finite number")
                n_in = int(rec["input_length"])
                n_out = int(rec["output_length"])
                ids = [_block_id(h) for h in rec["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ConfigError(
                    f"{p}:{lineno}: not a Mooncake trace record "
                    f"(need timestamp, input_length, output_length, hash_ids): {exc}"
                ) from None
            row = agentic_row(rec, p, lineno)
            parents, ts = deps.add(lineno, row, ts)
            if n_in <= 0 or n_out < 0 or len(ids) < n_in // block_size:
                raise ConfigError(
                    f"{p}:{lineno}: {len(ids)} hash_ids cannot cover input_length {n_in} "
                    f"with {block_size}-token blocks (wrong --trace-block-size?)"
                )
            if chained:
                for i, h in enumerate(ids):
                    parent = ids[i - 1] if i else -1
                    if parent_of.setdefault(h, parent) != parent:
                        raise ConfigError(
                            f"{p}:{lineno}: id {h} follows {parent} but earlier followed "
                            f"{parent_of[h]}: the trace is not chained (use --per-block-ids)"
                        )
            reqs.append(
                make_request(
                    len(reqs),
                    ts,
                    max(n_out, 1),
                    block_size,
                    ns,
                    block_ids=ids,
                    prompt_tokens=n_in,
                    chainer=chainer,
                    session_id=row.session_id,
                    parents=parents,
                )
            )
    deps.finish(reqs, truncated=truncated)
    if reqs and any(b.arrival_s < a.arrival_s for a, b in itertools.pairwise(reqs)):
        reqs.sort(key=lambda r: r.arrival_s)  # stable: ties keep file order
    attach_layouts(reqs, block_size)
    return Workload(
        name=p.stem,
        requests=reqs,
        block_size=block_size,
        model=model,
        params={
            "trace": p.name,
            "chained": chained,
            "block_size": block_size,
            **({"closed_loop": True, "prefix_resets": deps.prefix_resets} if deps.any else {}),
        },
        chained_ids=chained,
    )
