"""KEY=VALUE knobs of a simulated policy (`--replicate-opt`, `--retain-opt`, a grid
cell's `replicate` / `retain` table): every value a number, whole where the field is."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from quillcache.errors import ConfigError


def numeric_options(
    cls: type, options: dict[str, Any], *, what: str, ints: frozenset[str]
) -> dict[str, Any]:
    """`options` checked against the dataclass `cls`'s fields (`what` names them in an
    error), each a number (not a bool), an int for the fields in `ints`."""
    known = [f.name for f in fields(cls)]
    out: dict[str, Any] = {}
    for k, v in options.items():
        if k not in known:
            raise ConfigError(f"{what} option {k!r} unknown; known: {', '.join(known)}")
        whole = k in ints
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (whole and v != int(v)):
            raise ConfigError(f"{what} option {k}: {v!r} is not a number")
        out[k] = int(v) if whole else float(v)
    return out
