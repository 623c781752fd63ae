"""Identity and block hashing: namespaces, QuillCache's content key, vLLM parity.

The functions are the native ones (`quillcache._native`, GIL released, numpy in and
out); `quillcache.hashing.reference` is the slow pure-Python oracle.
"""

from __future__ import annotations

from quillcache._native import (
    Namespace,
    block_key,
    content_keys,
    content_keys_batch,
    namespace_id,
    vllm_block_hashes,
    vllm_event_hashes,
    vllm_none_hash,
)

__all__ = [
    "Namespace",
    "block_key",
    "content_keys",
    "content_keys_batch",
    "namespace_id",
    "vllm_block_hashes",
    "vllm_event_hashes",
    "vllm_none_hash",
]
