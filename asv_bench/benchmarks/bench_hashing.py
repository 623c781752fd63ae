"""Content keys of a 1,024-block request (16 tokens a block)."""

from __future__ import annotations

import numpy as np

from quillcache.hashing import content_keys, namespace_id


class ContentKeys:
    def setup(self) -> None:
        self.tokens = np.arange(1024 * 16, dtype=np.int64)
        self.ns = namespace_id(model="m", block_size=16)

    def time_content_keys_1024_blocks(self) -> None:
        content_keys(self.tokens, 16, self.ns)
