"""Benchmarks of the index backends (`quillcache bench-index`), see docs/persistence.md."""
