"""A request's namespace and content keys (docs/content-key.md).

The namespace is what the engine's events will carry for the same request: the
engine's base model (as registered with the index), the LoRA adapter the request
names, and the tenant (`cache_salt`). The native hasher is used when the extension
has it, the pure-Python reference otherwise (same keys, slower).
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from quillcache import _native
from quillcache.hashing import reference

_native_keys = getattr(_native, "content_keys", None)


@functools.lru_cache(maxsize=4096)
def namespace(model: str, tokenizer: str, lora: str, tenant: str, block_size: int) -> int:
    return reference.namespace_id(model, tokenizer, lora, tenant, block_size)


def content_keys(tokens: Sequence[int], block_size: int, ns: int) -> npt.NDArray[np.uint64]:
    """Keys of the full blocks of `tokens`, chained from namespace `ns`.

    Tokens go to the native hasher as a uint32 array: with a Python list, walking the
    list costs several times the hashing itself."""
    try:  # array('I') converts in C and rejects negative or > 32-bit ids
        arr = np.frombuffer(array("I", tokens), dtype=np.uint32)
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers that fit in 32 bits: {exc}") from None
    if _native_keys is not None:
        return np.asarray(_native_keys(arr, block_size, ns), dtype=np.uint64)
    return _python_keys(arr.astype(np.int64), block_size, ns)


def _python_keys(tokens: npt.NDArray[np.int64], block_size: int, ns: int) -> npt.NDArray[np.uint64]:
    """The reference chain with the token bytes packed once by numpy (same bytes, faster)."""
    n = len(tokens) // block_size
    data = tokens[: n * block_size].astype("<u4").tobytes()
    step = 4 * block_size
    out = np.empty(n, dtype=np.uint64)
    parent = ns
    for i in range(n):
        parent = xxhash.xxh3_64_intdigest(
            parent.to_bytes(8, "little") + data[i * step : (i + 1) * step], seed=reference.SEED
        )
        out[i] = parent
    return out
