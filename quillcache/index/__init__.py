"""Residency index backends and their registry."""

from __future__ import annotations

from quillcache.index.protocol import IndexBackend, KeyArray
from quillcache.index.registry import (
    ENTRY_POINT_GROUP,
    BackendUnavailableError,
    available_backends,
    backend_status,
    create_backend,
    register_backend,
)
from quillcache.index.types import (
    ApplyStats,
    Entry,
    IndexStats,
    Match,
    MatchColumns,
    Residency,
    SourceId,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ApplyStats",
    "BackendUnavailableError",
    "Entry",
    "IndexBackend",
    "IndexStats",
    "KeyArray",
    "Match",
    "MatchColumns",
    "Residency",
    "SourceId",
    "available_backends",
    "backend_status",
    "create_backend",
    "register_backend",
]
