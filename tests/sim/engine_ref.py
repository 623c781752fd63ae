"""An independent reference of the engine model's cache in order-only replay.

Between requests nothing runs, so every cached block is free and the cache is an LRU
list: a request takes its cached prefix out, evicts the least recently used blocks it
needs room for, and on finishing puts all its full prompt blocks back, last block
first (so a prompt's tail is evicted before its head, as vLLM frees them).
"""

from __future__ import annotations

from collections import OrderedDict


class ReferenceCache:
    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.lru: OrderedDict[int, None] = OrderedDict()

    def serve(self, keys: list[int], prompt_tokens: int, output_tokens: int) -> int:
        bs = self.block_size
        total = -(-(prompt_tokens + output_tokens) // bs)
        assert total <= self.capacity
        hit = 0
        for k in keys:
            if k not in self.lru:
                break
            hit += 1
        hit = min(hit, max((prompt_tokens - 1) // bs, 0))
        for k in keys[:hit]:
            del self.lru[k]
        empty = self.capacity - len(self.lru) - hit
        for _ in range(max(0, (total - hit) - empty)):
            self.lru.popitem(last=False)
        for k in reversed(keys):
            self.lru.pop(k, None)
            self.lru[k] = None
        return hit
