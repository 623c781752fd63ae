"""The OpenAI-compatible routing gateway (`quillcache gateway`).

- `config`: the pydantic configuration (YAML/TOML file plus flags).
- `keys`: namespace and content keys of a request.
- `tokenization`: token ids for routing (local tokenizer or the engine's /tokenize).
- `workers`: the engines: lifecycle, health checks, metrics scraping, event sources.
- `metrics`: the gateway's Prometheus metrics.
- `proxy`: forwarding a request upstream, streaming it back chunk by chunk.
- `app`: the starlette application (proxy, admin and ingest endpoints).
- `cli`: the subcommand.
"""

from __future__ import annotations
