"""Type stubs for the Rust extension `quillcache._native`.

Every call that does real work releases the GIL.
"""

from __future__ import annotations

__version__: str

class QuillCacheError(Exception): ...
class EventDecodeError(QuillCacheError): ...
class HashingError(QuillCacheError): ...

# --- hashing and events (rust/python/src/hashing.rs, events.rs) ---

# --- index (rust/python/src/index.rs) ---

# --- persistence (rust/python/src/persist.rs) ---
