"""Validation of caller input shared by every index backend.

Keys are content keys (`docs/content-key.md`): unsigned 64-bit. Worker ids are
unsigned 64-bit, dp ranks unsigned 32-bit. Anything else is rejected with
`InvalidIndexInputError` instead of wrapping around or overflowing in native code.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from quillcache.errors import QuillCacheError
from quillcache.index.protocol import KeyArray

_U64_MAX = (1 << 64) - 1
_U32_MAX = (1 << 32) - 1


class InvalidIndexInputError(QuillCacheError, ValueError):
    """A key, worker id or dp rank given to an index is out of range or of the wrong type."""


def as_key_array(keys: KeyArray | Iterable[int]) -> KeyArray:
    """A contiguous 1-D uint64 array of `keys` (no copy when it already is one)."""
    if isinstance(keys, np.ndarray):
        if keys.dtype == np.uint64 and keys.ndim == 1:
            return np.ascontiguousarray(keys)
        if keys.ndim != 1:
            raise InvalidIndexInputError(f"keys must be 1-D, got shape {keys.shape}")
        if keys.dtype.kind == "i":
            if keys.size and keys.min() < 0:
                raise InvalidIndexInputError("keys must be unsigned 64-bit; got a negative key")
            return keys.astype(np.uint64)
        if keys.dtype.kind != "u":
            raise InvalidIndexInputError(f"keys must be unsigned integers, got dtype {keys.dtype}")
        return keys.astype(np.uint64)
    values = list(keys)
    for k in values:
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or not 0 <= k <= _U64_MAX:
            raise InvalidIndexInputError(
                f"keys must be integers in 0 .. 2**64-1 (content keys), got {k!r}"
            )
    return np.array(values, dtype=np.uint64)


def check_source(worker: int, dp_rank: int) -> None:
    """Raise unless `worker` fits in u64 and `dp_rank` in u32."""
    if not isinstance(worker, (int, np.integer)) or not 0 <= worker <= _U64_MAX:
        raise InvalidIndexInputError(f"worker must be an integer in 0 .. 2**64-1, got {worker!r}")
    if not isinstance(dp_rank, (int, np.integer)) or not 0 <= dp_rank <= _U32_MAX:
        raise InvalidIndexInputError(f"dp_rank must be an integer in 0 .. 2**32-1, got {dp_rank!r}")


def check_medium(medium: str) -> str:
    """`medium` when it is a non-empty name in UTF-8 (the index normalises known ones:
    "cpu" is CPU); else `InvalidIndexInputError`."""
    if not isinstance(medium, str) or not medium:
        raise InvalidIndexInputError(f"medium must be a non-empty string, got {medium!r}")
    try:
        medium.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidIndexInputError(f"medium must be valid UTF-8, got {medium!r}") from None
    return medium
