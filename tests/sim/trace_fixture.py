"""Generate small Mooncake-format traces (never a copy of the shared one)."""

from __future__ import annotations

import json
import random
from pathlib import Path


def write_chained_trace(
    path: Path, *, sessions: int = 30, turns: int = 4, seed: int = 0, block_size: int = 512
) -> list[dict]:
    """Conversations: every request starts with block 0 (a shared system prompt); each
    turn resends the previous prompt's full blocks and adds new ones (fresh ids)."""
    rng = random.Random(seed)
    next_id = 1
    records = []
    for s in range(sessions):
        start = rng.uniform(0, 60_000)
        ids = [0]
        for t in range(turns):
            for _ in range(rng.randint(1, 5)):
                ids.append(next_id)
                next_id += 1
            n_in = (len(ids) - 1) * block_size + rng.randint(1, block_size)
            records.append(
                {
                    "timestamp": int(start + t * rng.uniform(5_000, 20_000)),
                    "input_length": n_in,
                    "output_length": rng.randint(1, 300),
                    "hash_ids": list(ids),
                    "session": s,
                }
            )
            # the last id covered a partial block: the next turn's block there is new
            ids[-1] = next_id
            next_id += 1
    records.sort(key=lambda r: r["timestamp"])
    with path.open("w") as fh:
        for r in records:
            fh.write(json.dumps({k: v for k, v in r.items() if k != "session"}) + "\n")
    return records


def write_per_block_trace(
    path: Path, *, requests: int = 60, seed: int = 0, block_size: int = 64
) -> list[dict]:
    """Ids name one block's content, drawn from a small pool, so the same id appears
    after different parents."""
    rng = random.Random(seed)
    records = []
    for i in range(requests):
        n = rng.randint(1, 8)
        ids = [rng.randint(0, 5) for _ in range(n)]
        records.append(
            {
                "timestamp": i * 100,
                "input_length": n * block_size - rng.randint(0, block_size - 1),
                "output_length": 10,
                "hash_ids": ids,
            }
        )
    with path.open("w") as fh:
        for r in records:
            fh.write(json.dumps(r) + "\n")
    return records


def ideal_prefix_hit_rate(records: list[dict], block_size: int, *, chained: bool) -> float:
    """One worker, unbounded cache: a block hits when its whole prefix was seen before.
    Only full blocks are cached and the last prompt token is always computed (vLLM)."""
    seen: set = set()
    hits = total = 0
    for r in records:
        n_in = r["input_length"]
        ids = r["hash_ids"]
        full = n_in // block_size
        names = list(ids[:full]) if chained else [tuple(ids[: i + 1]) for i in range(full)]
        h = 0
        for name in names:
            if name not in seen:
                break
            h += 1
        hits += min(h, (n_in - 1) // block_size)
        total += -(-n_in // block_size)
        seen.update(names)
    return hits / total
