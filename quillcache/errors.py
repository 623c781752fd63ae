"""Typed errors. Every message says what was wrong and, where it helps, what to do."""

from __future__ import annotations

from quillcache._native import (
    CorruptIndexError,
    EventDecodeError,
    HashingError,
    IndexLockedError,
    IngestRefusedError,
    PersistenceError,
    QuillCacheError,
)

__all__ = [
    "ConfigError",
    "CorruptIndexError",
    "EventDecodeError",
    "HashingError",
    "IndexLockedError",
    "IngestRefusedError",
    "PersistenceError",
    "QuillCacheError",
    "UnknownBackendError",
    "UnknownRouterError",
]


class ConfigError(QuillCacheError, ValueError):
    """A configuration value is invalid."""


class UnknownBackendError(QuillCacheError, KeyError):
    """No index backend is registered under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownRouterError(QuillCacheError, KeyError):
    """No router is registered under that name."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""
