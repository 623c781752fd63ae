"""Connectors: how engine KV events and engine metrics reach the control plane.

- `sequence`: per-source sequence tracking (gap, duplicate, restart), pure logic.
- `replay`: DEALER client of an engine's ROUTER replay socket.
- `zmq_source`: one SUB receiver thread per (endpoint, dp rank).
- `ingestor`: the bounded queue and the applier thread that feeds an `IngestSink`.
- `engine_metrics`: scraping an engine's Prometheus `/metrics`.
"""

from __future__ import annotations

from quillcache.connectors.ingestor import (
    EventIngestor,
    IngestorStats,
    IngestReceipt,
    SourcePosition,
    SourceStatus,
)
from quillcache.connectors.sink import IndexSink, IngestSink
from quillcache.connectors.zmq_source import ZmqSourceConfig

__all__ = [
    "EventIngestor",
    "IndexSink",
    "IngestReceipt",
    "IngestSink",
    "IngestorStats",
    "SourcePosition",
    "SourceStatus",
    "ZmqSourceConfig",
]
