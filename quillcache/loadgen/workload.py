"""What to send: a list of prompts with their arrival offsets and output lengths.

Synthetic: `prefixes` shared system prompts, each request one of them plus a unique
question (the shape that makes cache-aware routing matter). Trace: Mooncake's format
(`timestamp` ms, `hash_ids` chained per block, `output_length`); every hash id becomes
the same deterministic text chunk wherever it appears, so equal ids are equal prefixes
for any tokenizer that splits text the same way each time.
"""

from __future__ import annotations

import json
import math
import random
import string
from dataclasses import dataclass
from pathlib import Path

from quillcache.errors import ConfigError


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start (used in trace / rate mode)
    session: str | None = None


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        w = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 8)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:chars]


def synthetic(
    requests: int,
    *,
    prefixes: int = 8,
    prefix_chars: int = 1024,
    suffix_chars: int = 64,
    max_tokens: int = 16,
    seed: int = 0,
) -> list[LoadRequest]:
    if requests < 1 or prefixes < 1:
        raise ConfigError("--requests and --prefixes must be at least 1")
    rng = random.Random(seed)
    heads = [_text(random.Random(seed * 1000 + i), prefix_chars) for i in range(prefixes)]
    out = []
    for i in range(requests):
        group = rng.randrange(prefixes)
        prompt = f"{heads[group]}\nQuestion {i}: {_text(rng, suffix_chars)}"
        out.append(LoadRequest(prompt, max_tokens, session=f"s{group}"))
    return out


def mooncake_trace(
    path: str | Path,
    *,
    requests: int | None = None,
    block_chars: int = 64,
    max_tokens: int = 16,
    time_scale: float = 1.0,
) -> list[LoadRequest]:
    """Requests of a Mooncake-format trace (timestamps in ms, scaled by `time_scale`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"trace {path} is a directory, not a JSONL file")
    if not path.is_file():
        raise ConfigError(f"trace {path} does not exist")
    chunks: dict[int, str] = {}
    out: list[LoadRequest] = []
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if requests is not None and len(out) >= requests:
                break
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.decode("utf-8"))
                ids = [int(h) for h in rec["hash_ids"]]
                ts = float(rec.get("timestamp", 0)) / 1000.0
                out_len = int(rec.get("output_length", max_tokens))
            except (ValueError, KeyError, TypeError) as exc:  # UnicodeDecodeError included
                raise ConfigError(f"trace {path}:{line_no}: not a Mooncake record: {exc}") from exc
            if not ids:
                raise ConfigError(f"trace {path}:{line_no}: a record without hash_ids")
            if not (math.isfinite(ts) and ts >= 0):
                raise ConfigError(
                    f"trace {path}:{line_no}: timestamp must be a finite number of ms >= 0"
                )
            parts = []
            for h in ids:
                if h not in chunks:
                    chunks[h] = _text(random.Random(h), block_chars - 1) + " "
                parts.append(chunks[h])
            out.append(
                LoadRequest("".join(parts), max(1, min(out_len, max_tokens)), ts * time_scale)
            )
    if not out:
        raise ConfigError(f"trace {path} has no records")
    return out
