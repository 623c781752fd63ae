"""`quillcache engine-sim`: run one simulated vLLM engine."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from quillcache.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on")
    a("--port", type=int, default=8100, help="HTTP port (0: any free port, see --ready-file)")
    a("--model", default="sim-model", help="served model name")
    a("--lora-modules", nargs="*", default=[], help="LoRA adapter names served as models")
    a("--tokenizer", default="builtin", help="'builtin' (one id per byte) or a tokenizer.json")
    a("--block-size", type=int, default=16, help="KV block size in tokens")
    a("--num-gpu-blocks", type=int, default=4096, help="prefix-cache capacity in blocks")
    a("--max-num-seqs", type=int, default=256, help="requests running at once")
    a("--max-model-len", type=int, default=8192, help="longest prompt + output, in tokens")
    a("--time-scale", type=float, default=1.0, help="multiplies every latency (0 = no waits)")
    a(
        "--fixed-latency-ms",
        default=None,
        metavar="TTFT,ITL",
        help="a steady upstream for measuring a proxy's overhead: each request takes this "
        "(first token, then each next token) times a factor in [1, 2) fixed by its prompt, "
        "whatever the load (no model, no cache, no events)",
    )
    a("--cost-config", default=None, help="cost model JSON/YAML (default: 8B model on A100)")
    a(
        "--kv-events-config",
        default=None,
        help='vLLM\'s JSON, e.g. \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv"}\'',
    )
    a("--legacy-replay", action="store_true", help="reply [b'', seq, payload] (vLLM < 0.26)")
    a(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores (DP ranks), each with its own KV-event socket at the base port + rank",
    )
    a(
        "--flavor",
        choices=["vllm", "sglang"],
        default="vllm",
        help="whose HTTP surface to serve: vLLM's (/kv_event_sources, vllm: metrics) or "
        "SGLang's (/server_info with kv_events_config, sglang: metrics)",
    )
    a("--ready-file", default=None, help="write the resolved addresses here as JSON when up")
    a("--log-level", default="warning", help="uvicorn's log level")


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


def _rank_endpoint(endpoint: str, rank: int) -> str:
    """Rank r's endpoint: the base port + r (vLLM's rule). A wildcard port (`:*`, `:0`)
    stays one: each rank binds its own free port and /kv_event_sources says which."""
    from quillcache.connectors.zmq_source import with_rank

    if rank == 0 or endpoint.endswith((":*", ":0")):
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}-{rank}"
    return with_rank(endpoint, rank)


def _fixed_latency(spec: str | None) -> tuple[float, float] | None:
    if spec is None:
        return None
    try:
        ttft, itl = (float(v) / 1000 for v in spec.split(","))
    except ValueError:
        raise ConfigError(f"--fixed-latency-ms wants 'TTFT,ITL' in ms, got {spec!r}") from None
    if ttft < 0 or itl < 0:
        raise ConfigError("--fixed-latency-ms: latencies must be >= 0")
    return ttft, itl


def run(args: argparse.Namespace) -> int:
    from quillcache.costmodel import CostModelConfig
    from quillcache.enginesim.app import EngineApp
    from quillcache.enginesim.engine import EngineConfig
    from quillcache.enginesim.publisher import KvEventPublisher
    from quillcache.tokenization.local import load_tokenizer

    try:
        kv = _kv_config(args.kv_events_config)
        tokenizer = load_tokenizer(args.tokenizer)
        cost = CostModelConfig.load(args.cost_config) if args.cost_config else None
        fixed = _fixed_latency(args.fixed_latency_ms)
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
        fixed_latency_s=fixed,
    )
    if args.data_parallel_size < 1:
        print("engine-sim: --data-parallel-size must be at least 1", file=sys.stderr)
        return 2
    publishers: list[KvEventPublisher] = []
    if kv is not None:
        replay = kv.get("replay_endpoint")
        for rank in range(args.data_parallel_size):  # rank r: base port + r, like vLLM
            publishers.append(
                KvEventPublisher(
                    _rank_endpoint(kv.get("endpoint", "tcp://*:5557"), rank),
                    _rank_endpoint(replay, rank) if replay else None,
                    topic=kv.get("topic", ""),
                    buffer_steps=int(kv.get("buffer_steps", 10_000)),
                    hwm=int(kv.get("hwm", 100_000)),
                    legacy_replay=args.legacy_replay,
                )
            )
    publisher = publishers[0] if publishers else None
    app = EngineApp(
        config, tokenizer, publishers or None, args.data_parallel_size, flavor=args.flavor
    )

    async def serve() -> None:
        from quillcache.serving import serve_app

        extra = {
            "kv_endpoint": publisher.endpoint if publisher else None,
            "replay_endpoint": publisher.replay_endpoint if publisher else None,
        }
        await serve_app(
            app.starlette(), args.host, args.port, args.log_level, extra, args.ready_file
        )

    from quillcache.serving import run_loop

    try:
        run_loop(serve())
    finally:
        for p in publishers:
            p.close()
    return 0
