"""The engine simulator: a stand-in vLLM worker (`quillcache engine-sim`).

- `publisher`: the ZMQ PUB of KV events and the ROUTER replay socket (vLLM's wire format).
- `tokenizer`: the built-in deterministic tokenizer, or a tokenizer.json.
- `engine`: prefix cache, timing and events of the simulated engine.
- `app`: vLLM's HTTP surface (starlette).
- `cli`: the subcommand.
"""

from __future__ import annotations
