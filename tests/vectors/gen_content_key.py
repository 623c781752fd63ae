"""Regenerates tests/vectors/content_key.json from the pure-Python reference.

    python -m tests.vectors.gen_content_key

The vectors are normative (docs/content-key.md): regenerate only for a new key version.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from quillcache.hashing import reference as ref

OUT = Path(__file__).resolve().parent / "content_key.json"

NAMESPACES: list[dict[str, Any]] = [
    {"model": "", "tokenizer": "", "lora": "", "tenant": "", "block_size": 16, "extra": []},
    {
        "model": "llama-3-8b",
        "tokenizer": "",
        "lora": "",
        "tenant": "",
        "block_size": 16,
        "extra": [],
    },
    {
        "model": "llama-3-8b",
        "tokenizer": "",
        "lora": "sql-lora",
        "tenant": "tenant-a",
        "block_size": 16,
        "extra": [],
    },
    {
        "model": "Qwen/Qwen2.5-7B",
        "tokenizer": "sha256:3f1c",
        "lora": "",
        "tenant": "",
        "block_size": 4,
        "extra": ["prompt-embeds-v1"],
    },
    {
        "model": "模型",
        "tokenizer": "",
        "lora": "",
        "tenant": "ünïcode",
        "block_size": 128,
        "extra": ["a", ""],
    },
]

CHAINS: list[dict[str, Any]] = [
    {"namespace": 1, "tokens": list(range(1, 33))},
    {"namespace": 1, "tokens": list(range(1, 40))},  # partial tail: 2 keys
    {"namespace": 2, "tokens": list(range(1, 33))},  # same tokens, other tenant/adapter
    {"namespace": 3, "tokens": [0, 1, 4294967295, 65536, 7, 7, 7, 7, 128000, 2, 3]},
    {"namespace": 4, "tokens": [i * 7919 % 152064 for i in range(256)]},
    {"namespace": 0, "tokens": list(range(15))},  # no full block: no keys
    {
        "namespace": 3,
        "tokens": list(range(100, 112)),
        # Per block: None or [(mm_hash, offset_in_block), ...] (vLLM's ("mm", hash, offset)).
        "mm": [[["img-0f3a", 2]], None, [["img-0f3a", -2], ["aud-77", 3]]],
    },
]


def build() -> dict[str, Any]:
    namespaces = []
    for ns in NAMESPACES:
        namespaces.append({**ns, "id": ref.namespace_id(**ns)})
    chains = []
    for chain in CHAINS:
        ns = namespaces[chain["namespace"]]
        bs, toks, mm = ns["block_size"], chain["tokens"], chain.get("mm")
        keys, parent = [], ns["id"]
        for i, start in enumerate(range(0, len(toks) - bs + 1, bs)):
            items = mm[i] if mm is not None and i < len(mm) else None
            parent = ref.block_key(
                parent, toks[start : start + bs], [tuple(x) for x in items] if items else None
            )
            keys.append(parent)
        chains.append({**chain, "keys": keys})
    return {
        "spec": "docs/content-key.md (quillcache-ns-v1)",
        "seed": ref.SEED,
        "namespaces": namespaces,
        "chains": chains,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(build(), indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")
