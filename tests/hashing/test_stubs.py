"""The "hashing and events" section of quillcache/_native.pyi names exactly what exists."""

from __future__ import annotations

import ast
from pathlib import Path

import quillcache
from quillcache import _native

STUB = Path(quillcache.__file__).with_name("_native.pyi").read_text()


def _section_names() -> set[str]:
    start = STUB.index("# --- hashing and events")
    end = STUB.index("# ---", start + 5)
    tree = ast.parse(STUB[start:end])
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_")}


def test_every_stubbed_name_exists_at_runtime() -> None:
    names = _section_names()
    assert {"decode_batch", "content_keys", "Namespace", "vllm_block_hashes"} <= names
    missing = sorted(n for n in names if not hasattr(_native, n))
    assert not missing


def test_every_hashing_and_events_export_is_stubbed() -> None:
    from quillcache import events, hashing

    exported = {n for n in hashing.__all__} | {
        n for n in events.__all__ if getattr(events, n) is getattr(_native, n, None)
    }
    assert exported <= _section_names()
