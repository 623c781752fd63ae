"""A request's identity: its namespace and its content keys (docs/content-key.md).

One home for every part that names a request's blocks: the gateway (client requests,
the parity probes), the simulator (workloads and traces) and the engine simulator (the
blocks it caches and publishes). The namespace is what the engine's events carry back
for the same request: the engine's base model as registered with the index, the
tokenizer identity, the LoRA adapter the request names, and the engine's cache salt
(the gateway derives that salt per tenant: `quillcache.gateway.tenancy`). The hashing
is the native one; `quillcache.hashing.reference` is the pure-Python oracle the tests
compare against.
"""

from __future__ import annotations

import functools
from array import array
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from quillcache import _native


@functools.lru_cache(maxsize=4096)
def namespace(model: str, tokenizer: str, lora: str, salt: str, block_size: int) -> int:
    """The namespace id (cached: a gateway sees few distinct identities)."""
    return _native.namespace_id(model, tokenizer, lora, salt, block_size)


def content_keys(
    tokens: Sequence[int] | npt.NDArray[np.uint32], block_size: int, ns: int
) -> npt.NDArray[np.uint64]:
    """Keys of the full blocks of `tokens`, chained from namespace `ns`.

    A list goes to the native hasher as a uint32 array: `array('I')` converts it in C
    and rejects negative or wider-than-32-bit ids; walking a Python list in the binding
    costs several times more."""
    if isinstance(tokens, np.ndarray):
        arr = np.asarray(tokens, dtype=np.uint32)
    else:
        try:
            arr = np.frombuffer(array("I", tokens), dtype=np.uint32)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers that fit in 32 bits: {exc}") from None
    return np.asarray(_native.content_keys(arr, block_size, ns), dtype=np.uint64)
