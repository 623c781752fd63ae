"""`quillcache engine-sim`: run one simulated vLLM engine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from quillcache.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8100, help="HTTP port (0: any free port, see --ready-file)")
    a("--model", default="sim-model", help="served model name")
    a("--lora-modules", nargs="*", default=[], help="LoRA adapter names served as models")
    a("--tokenizer", default="builtin", help="'builtin' (one id per byte) or a tokenizer.json")
    a("--block-size", type=int, default=16)
    a("--num-gpu-blocks", type=int, default=4096, help="prefix-cache capacity in blocks")
    a("--max-num-seqs", type=int, default=256, help="requests running at once")
    a("--max-model-len", type=int, default=8192)
    a("--time-scale", type=float, default=1.0, help="multiplies every latency (0 = no waits)")
    a("--cost-config", default=None, help="cost model JSON/YAML (default: 8B model on A100)")
    a(
        "--kv-events-config",
        default=None,
        help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\'',
    )
    a("--legacy-replay", action="store_true", help="reply [b'', seq, payload] (vLLM < 0.26)")
    a("--ready-file", default=None, help="write the resolved addresses here as JSON when up")
    a("--log-level", default="warning")


def _kv_config(raw: str | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        cfg = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--kv-events-config is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError("--kv-events-config must be a JSON object")
    if not cfg.get("enable_kv_cache_events", False):
        return None
    if cfg.get("publisher", "zmq") != "zmq":
        raise ConfigError(f"unsupported publisher {cfg.get('publisher')!r}; only 'zmq'")
    return cfg


def run(args: argparse.Namespace) -> int:
    import asyncio

    from quillcache.costmodel import CostModelConfig
    from quillcache.enginesim.app import EngineApp
    from quillcache.enginesim.engine import EngineConfig
    from quillcache.enginesim.publisher import KvEventPublisher
    from quillcache.enginesim.tokenizer import load_tokenizer

    try:
        kv = _kv_config(args.kv_events_config)
        tokenizer = load_tokenizer(args.tokenizer)
        cost = CostModelConfig.load(args.cost_config) if args.cost_config else None
    except ConfigError as exc:
        print(f"engine-sim: {exc}", file=sys.stderr)
        return 2
    config = EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        cost=cost,
        lora_modules=list(args.lora_modules),
    )
    publisher = None
    if kv is not None:
        publisher = KvEventPublisher(
            kv.get("endpoint", "tcp://*:5557"),
            kv.get("replay_endpoint"),
            topic=kv.get("topic", ""),
            buffer_steps=int(kv.get("buffer_steps", 10_000)),
            hwm=int(kv.get("hwm", 100_000)),
            legacy_replay=args.legacy_replay,
        )
    app = EngineApp(config, tokenizer, publisher)

    async def serve() -> None:
        from quillcache.gateway.serve import serve_app

        extra = {
            "kv_endpoint": publisher.endpoint if publisher else None,
            "replay_endpoint": publisher.replay_endpoint if publisher else None,
        }
        await serve_app(
            app.starlette(), args.host, args.port, args.log_level, extra, args.ready_file
        )

    try:
        asyncio.run(serve())
    finally:
        if publisher is not None:
            publisher.close()
    return 0
