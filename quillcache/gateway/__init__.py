"""The OpenAI-compatible routing gateway (`quillcache gateway`).

- `config`: the pydantic configuration (YAML/TOML file plus flags).
- `keys`: namespace and content keys of a request.
- `tokenization`: token ids for routing (local tokenizer or the engine's /tokenize).
- `workers`: the engines: lifecycle, health checks, metrics scraping, event sources.
- `metrics`: the gateway's Prometheus metrics.
- `app`: the `Gateway`: its parts, lifecycle, request identity, the ASGI app.
- `openai_api`: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.
- `proxy`: forwarding a request upstream, streaming it back chunk by chunk.
- `admin`: the `/admin/...` API; `ingest_http`: `POST /ingest/kv_events`.
- `parity`: the startup parity self-check against each engine.
- `httpio`: body reading, validation, auth and `ApiError`; `asgi`: endpoint wrappers
  and the fast path of the proxy endpoints.
- `serve`: running an app under uvicorn on uvloop.
- `cli`: the subcommand.
"""

from __future__ import annotations
