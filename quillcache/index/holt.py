"""`HoltIndex` ("holt"): the index kept in Holt, a persistent adaptive radix tree
(the engine the original study used), for the ART-vs-LSM study.

Same Rust implementation of the index semantics as the RocksDB backend
(`quillcache.index.rocks`), over Holt 0.9.2 built without io_uring. Needs the
extension built with the ``holt`` cargo feature::

    maturin develop --release --features holt
"""

from __future__ import annotations

from quillcache.index.rocks import KvStoreIndex

__all__ = ["HoltIndex"]


class HoltIndex(KvStoreIndex):
    """The key-value index in Holt (needs the ``holt`` cargo feature)."""

    name = "holt"
    store = "holt"
