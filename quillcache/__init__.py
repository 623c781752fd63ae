"""QuillCache: the KV-cache control plane for LLM serving."""

from __future__ import annotations

from quillcache._native import __version__

__all__ = ["__version__"]
