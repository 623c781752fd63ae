"""Medium names are bounded alike in every backend: a name too long, or one unknown name
too many, goes to the OTHER medium (counted in `stats().extra["media_folded"]`), so a
publisher inventing names cannot grow the index; known tiers are always kept."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import prometheus_client.registry
import pytest
from prometheus_client import generate_latest
from prometheus_client.registry import CollectorRegistry

from quillcache.connectors.ingestor import IngestorStats
from quillcache.events.types import KNOWN_MEDIA, MAX_CUSTOM_MEDIA, OTHER_MEDIUM
from quillcache.gateway.metrics import state_metrics
from quillcache.index import IndexBackend
from tests.index.helpers import backends, keys, make, payload, removed, stored, toks


@pytest.fixture(params=backends())
def index(request: pytest.FixtureRequest) -> Iterator[IndexBackend]:
    idx = make(request.param)
    yield idx
    idx.close()


def media_of(index: IndexBackend, tokens: list[int]) -> list[str]:
    return sorted(m.medium for m in index.match(keys(tokens)))


def test_300_long_medium_names_leave_memory_bounded(index: IndexBackend) -> None:
    t = toks(1)
    index.apply(0, [payload(stored([1], t))])
    before = index.stats().memory_bytes
    for i in range(300):  # each an offload of the block the source already holds
        name = f"{i:04}" + "x" * (1 << 20)
        index.apply(0, [payload(stored([1], [], medium=name))])
    stats = index.stats()
    grown = stats.memory_bytes - before
    # kept, the names would be 300 MiB; a store's own buffers may grow by a block (the
    # RocksDB memtable arena allocates 1 MiB at a time)
    assert grown < 2 << 20, f"300 distinct 1 MiB medium names grew the index by {grown} bytes"
    assert stats.extra["media_folded"] == 300
    assert media_of(index, t) == ["GPU", OTHER_MEDIUM]
    # removing under an over-long name finds what its store put in OTHER
    s = index.apply(0, [payload(removed([1], medium="0000" + "x" * (1 << 20)))])
    assert (s.blocks_removed, s.unknown_removals) == (1, 0)


def test_unknown_names_beyond_the_limit_fold_and_known_ones_never_do(
    index: IndexBackend,
) -> None:
    t = toks(1)
    index.apply(0, [payload(stored([1], t))])
    for i in range(40):
        index.apply(0, [payload(stored([1], [], medium=f"tier{i}"))])
    assert index.stats().extra["media_folded"] == 40 - MAX_CUSTOM_MEDIA
    for name in (*KNOWN_MEDIA, "CPU_PINNED", "STORAGE", "localcpubackend"):
        index.apply(0, [payload(stored([1], [], medium=name))])
    assert index.stats().extra["media_folded"] == 40 - MAX_CUSTOM_MEDIA
    expected = sorted(
        {f"tier{i}" for i in range(MAX_CUSTOM_MEDIA)}
        | set(KNOWN_MEDIA)
        | {"GPU", "CPU", "DISK", "localcpubackend"}
    )
    assert media_of(index, t) == expected


def test_the_gateway_exports_the_folded_count(index: IndexBackend) -> None:
    index.apply(0, [payload(stored([1], toks(1), medium="y" * 100))])

    class Collector(prometheus_client.registry.Collector):
        def collect(self) -> Iterator[Any]:
            return state_metrics(IngestorStats(), index.stats(), [], lambda _w: 0.0)

    registry = CollectorRegistry()
    registry.register(Collector())
    text = generate_latest(registry).decode()
    assert "quillcache_index_media_folded_total 1.0" in text
