"""Shared inputs: the seed workload's event batches (2,000 requests x 20 blocks)."""

from __future__ import annotations

import functools

from quillcache.bench import workloads


@functools.lru_cache(maxsize=1)
def seed() -> workloads.Workload:
    return workloads.seed(queries=2_000)


def payloads() -> list[bytes]:
    return [b[1] for b in seed().batches]
