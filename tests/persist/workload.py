"""A deterministic stream of vLLM event batches for the persistence tests.

`batch(seed, i)` depends only on (seed, i), so a crashed child and the checking
parent build exactly the same bytes: the parent replays the acknowledged prefix into
a plain in-memory index and compares.
"""

from __future__ import annotations

import random

from quillcache.events import encode as enc

BLOCK_SIZE = 4


def batch(seed: int, i: int) -> bytes:
    """Batch number `i`: stores chained onto earlier batches' blocks, some removals,
    rarely a full clear; hashes are unique per (i, j) so removals name real blocks."""
    rng = random.Random(seed * 1_000_003 + i)
    events: list[enc.Event] = []
    for j in range(rng.randint(1, 4)):
        roll = rng.random()
        if roll < 0.7 or i == 0:
            n = rng.randint(1, 6)
            parent = None
            if i > 0 and rng.random() < 0.8:
                p = rng.randrange(max(0, i - 50), i)
                parent = p * 1000 + rng.randrange(0, 6)
            base = i * 1000 + j * 100
            events.append(
                enc.BlockStored(
                    block_hashes=[base + k for k in range(n)],
                    parent_block_hash=parent,
                    token_ids=[rng.randrange(0, 64) for _ in range(n * BLOCK_SIZE)],
                    block_size=BLOCK_SIZE,
                    medium=rng.choice(["GPU", "GPU", "CPU"]),
                )
            )
        elif roll < 0.98:
            p = rng.randrange(max(0, i - 50), i)
            hashes = [p * 1000 + rng.randrange(0, 400) for _ in range(rng.randint(1, 3))]
            events.append(enc.BlockRemoved(block_hashes=hashes, medium="GPU"))
        else:
            events.append(enc.AllBlocksCleared())
    return enc.encode_batch(events, ts=float(i), dp_rank=0)
