"""`quillcache engine-sim`: run one simulated vLLM engine, or N of them in one process
(`--engines N`, `fleet.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from quillcache.errors import ConfigError

if TYPE_CHECKING:
    from quillcache.costmodel import CostModelConfig
    from quillcache.enginesim.app import EngineApp
    from quillcache.enginesim.engine import EngineConfig
    from quillcache.enginesim.lmcache_controller import LmcacheControllerSim


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--host", default="127.0.0.1", help="address to listen on")
    a(
        "--port",
        type=int,
        default=8100,
        help="HTTP port; with --engines N, engine i listens on PORT + i (0: any free port "
        "each, see --ready-file)",
    )
    a(
        "--engines",
        type=int,
        default=1,
        help="simulated engines served by this one process, each with its own HTTP port, "
        "KV cache, /metrics and KV-event sockets (a fixed KV port: engine i at the base "
        "port + i x --data-parallel-size)",
    )
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
    a(
        "--sglang-version",
        default=None,
        metavar="RELEASE",
        help="with --flavor sglang: the SGLang release whose KV-event format to publish "
        "(default 0.5.23; 'legacy' = 0.5.19, 'current' = 0.5.23): <= 0.5.19 tagged "
        "arrays (0.5.18-0.5.19 with the salt in a metadata map), >= 0.5.20 tagged maps; "
        "replay replies without the topic frame before 0.5.22",
    )
    a(
        "--lmcache",
        choices=["vllm", "mp"],
        default=None,
        help="LMCache beside each engine: publish its CPU-tier chunks as its connector makes "
        "vLLM do ('vllm': in-process LMCacheConnectorV1, medium 'cpu', no evictions; 'mp': "
        "LMCache's multiprocess connector, medium 'CPU', evictions reported)",
    )
    a("--lmcache-chunk-size", type=int, default=256, help="LMCache's chunk size in tokens")
    a("--lmcache-cpu-chunks", type=int, default=1024, help="LMCache's CPU tier size, in chunks")
    a(
        "--lmcache-controller",
        action="store_true",
        help="with --lmcache vllm: also serve LMCache's cache controller API (/lookup, /move, "
        "/clear, /pin, /health, /check_finish; LMCache 0.5.6's shapes and errors) over every "
        "engine's LMCache instance, on the port after the engines' (a free one with --port 0); "
        "engine i is instance lmcache-instance-<i>, with P2P on; the ready file names both",
    )
    a(
        "--kv-groups",
        type=int,
        default=1,
        help="KV-cache groups to publish, as vLLM does for a hybrid model: each store and "
        "removal once per group (group 0 full attention, the others sliding window), every "
        "group mirroring the one cache; 1 (default) names none; --flavor vllm only",
    )
    a(
        "--prefix-caching-hash-algo",
        choices=["xxh3_64_sim", "sha256_cbor", "sha256"],
        default="xxh3_64_sim",
        help="block hashes the KV events carry, stated in vllm:cache_config_info: the "
        "simulator's own (xxh3_64_sim), or vLLM's sha256_cbor / sha256 (pickle) chain",
    )
    a(
        "--hash-seed",
        default=None,
        metavar="SEED",
        help="vLLM's PYTHONHASHSEED: NONE_HASH is the hash of this string (unset: "
        "'vllm-none-hash'); with sha256_cbor / sha256 only",
    )
    a(
        "--mm-hasher-algorithm",
        choices=["blake3", "sha256", "sha512"],
        default="blake3",
        help="vLLM's multimodal hash of an image_url part (blake3, vLLM's default, needs "
        "the blake3 package)",
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


def _sglang_release(flavor: str, release: str | None) -> str | None:
    """The SGLang release to simulate (`--sglang-version`), None for vLLM."""
    from quillcache.enginesim.sglang import DEFAULT_RELEASE, RELEASE_ALIASES
    from quillcache.events.sglang import wire_of

    if flavor != "sglang":
        if release is not None:
            raise ConfigError("--sglang-version needs --flavor sglang")
        return None
    release = RELEASE_ALIASES.get(release or "", release or DEFAULT_RELEASE)
    try:
        wire_of(release)
    except ValueError as exc:
        raise ConfigError(f"--sglang-version: {exc}") from None
    return release


def _check_hashing(args: argparse.Namespace) -> None:
    """vLLM's hash algorithms are for vLLM engines; a seed needs one of them."""
    if args.prefix_caching_hash_algo != "xxh3_64_sim" and args.flavor != "vllm":
        raise ConfigError("--prefix-caching-hash-algo is vLLM's; it needs --flavor vllm")
    if args.hash_seed is not None and args.prefix_caching_hash_algo == "xxh3_64_sim":
        raise ConfigError("--hash-seed needs --prefix-caching-hash-algo sha256_cbor or sha256")


def _check_kv_groups(args: argparse.Namespace) -> None:
    """`--kv-groups` is vLLM's wire format, for the engine's own GPU cache."""
    if args.kv_groups == 1:
        return
    if not 1 <= args.kv_groups <= 32:
        raise ConfigError("--kv-groups must be in 1..32")
    if args.flavor != "vllm" or args.lmcache is not None:
        raise ConfigError("--kv-groups is modelled for --flavor vllm without --lmcache")


def _check_lmcache(args: argparse.Namespace) -> None:
    """`--lmcache` needs a vLLM engine, and a chunk size LMCache's connector accepts."""
    if args.lmcache_controller and (args.lmcache != "vllm" or args.data_parallel_size != 1):
        # LMCache's multiprocess server registers no worker with a controller
        raise ConfigError(
            "--lmcache-controller is modelled for --lmcache vllm with one rank per engine"
        )
    if args.lmcache is None:
        return
    if args.flavor != "vllm":
        raise ConfigError("--lmcache is modelled for --flavor vllm only")
    if args.lmcache_chunk_size < 1 or args.lmcache_cpu_chunks < 1:
        raise ConfigError("--lmcache-chunk-size and --lmcache-cpu-chunks must be at least 1")
    if args.lmcache == "mp" and args.lmcache_chunk_size % args.block_size:
        raise ConfigError(
            f"--lmcache-chunk-size {args.lmcache_chunk_size} must be a multiple of "
            f"--block-size {args.block_size} with --lmcache mp (LMCache refuses it)"
        )


def _engine_config(
    args: argparse.Namespace,
    cost: CostModelConfig | None,
    fixed: tuple[float, float] | None,
    sglang_release: str | None,
) -> EngineConfig:
    """Every engine's configuration (ConfigError for a value no engine can run with)."""
    from quillcache.enginesim.engine import EngineConfig

    return EngineConfig(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        time_scale=args.time_scale,
        cost=cost,
        lora_modules=list(args.lora_modules),
        fixed_latency_s=fixed,
        sglang_release=sglang_release,
        lmcache=args.lmcache,
        lmcache_chunk_size=args.lmcache_chunk_size,
        lmcache_cpu_chunks=args.lmcache_cpu_chunks,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        hash_seed=args.hash_seed,
        kv_groups=args.kv_groups,
        mm_hasher_algorithm=args.mm_hasher_algorithm,
    )


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


def lmcache_instance_id(engine: int) -> str:
    """The LMCache instance id of engine `engine` under `--lmcache-controller`."""
    return f"lmcache-instance-{engine}"


def lmcache_controller(apps: list[EngineApp]) -> LmcacheControllerSim:
    """LMCache's controller over the engines' LMCache tiers (rank 0 each)."""
    from quillcache.enginesim.lmcache_controller import Instance, LmcacheControllerSim

    instances = []
    for i, app in enumerate(apps):
        tier = app.ranks[0].lmcache
        assert tier is not None  # --lmcache-controller requires --lmcache
        instances.append(Instance(lmcache_instance_id(i), tier))
    return LmcacheControllerSim(instances)


def run(args: argparse.Namespace) -> int:
    import zmq

    from quillcache.connectors.zmq_source import raise_socket_limit
    from quillcache.costmodel import CostModelConfig
    from quillcache.enginesim import fleet, sglang
    from quillcache.enginesim.app import EngineApp
    from quillcache.enginesim.publisher import KvEventPublisher, ReplayHub
    from quillcache.tokenization.local import load_tokenizer

    n, dp = args.engines, args.data_parallel_size
    try:
        fleet.check_counts(n, args.port, dp)
        kv = _kv_config(args.kv_events_config)
        tokenizer = load_tokenizer(args.tokenizer)
        cost = CostModelConfig.load(args.cost_config) if args.cost_config else None
        fixed = _fixed_latency(args.fixed_latency_ms)
        if kv is not None:  # every port the last engine's last rank needs exists
            for key in ("endpoint", "replay_endpoint"):
                if kv.get(key):
                    fleet.offset_endpoint(kv[key], n * dp - 1)
        sglang_release = _sglang_release(args.flavor, args.sglang_version)
        _check_lmcache(args)
        _check_hashing(args)
        _check_kv_groups(args)
        config = _engine_config(args, cost, fixed, sglang_release)
        controller = 1 if args.lmcache_controller else 0  # its socket after the engines'
        fleet.check_counts(n + controller, args.port, dp)
        sockets = fleet.listen(args.host, args.port, n + controller) if n + controller > 1 else None
    except ConfigError as exc:
        print(f"engine-sim: {exc}", file=sys.stderr)
        return 2
    replay_layout: dict[str, bool] = {"legacy_replay": args.legacy_replay}
    if sglang_release is not None:
        replay_layout = sglang.replay_layout(sglang_release)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    if n > 1:  # libzmq's default is 1,023 sockets a context; each engine rank takes two
        raise_socket_limit(ctx)
    hub = ReplayHub() if n > 1 else None  # one replay thread for the whole fleet
    publishers: list[KvEventPublisher] = []
    apps: list[EngineApp] = []
    try:
        for i in range(n):
            mine: list[KvEventPublisher] = []
            if kv is not None:
                replay = kv.get("replay_endpoint")
                for rank in range(dp):  # rank r: base port + r, like vLLM
                    offset = i * dp + rank
                    mine.append(
                        KvEventPublisher(
                            fleet.offset_endpoint(kv.get("endpoint", "tcp://*:5557"), offset),
                            fleet.offset_endpoint(replay, offset) if replay else None,
                            topic=kv.get("topic", ""),
                            buffer_steps=int(kv.get("buffer_steps", 10_000)),
                            hwm=int(kv.get("hwm", 100_000)),
                            **replay_layout,
                            ctx=ctx,
                            replay_hub=hub,
                        )
                    )
            publishers += mine
            apps.append(EngineApp(config, tokenizer, mine or None, dp, flavor=args.flavor))
    except zmq.ZMQError as exc:
        print(
            f"engine-sim: engine {len(apps)}: cannot open its KV-event sockets: {exc}",
            file=sys.stderr,
        )
        for p in publishers:
            p.close()
        if hub is not None:
            hub.close()
        for sock in sockets or []:
            sock.close()
        return 2
    if hub is not None:
        hub.start()

    def describe(app: EngineApp, port: int) -> dict[str, Any]:
        pub = app.publishers[0]
        out = {
            "url": f"http://{args.host}:{port}",
            "port": port,
            "kv_endpoint": pub.endpoint if pub else None,
            "replay_endpoint": pub.replay_endpoint if pub else None,
        }
        if controller:
            out["lmcache_instance_id"] = lmcache_instance_id(apps.index(app))
        return out

    async def serve() -> None:
        from quillcache.serving import serve_app

        if sockets is None:
            app = apps[0]
            await serve_app(
                app.starlette(),
                args.host,
                args.port,
                args.log_level,
                {k: v for k, v in describe(app, 0).items() if k.endswith("endpoint")},
                args.ready_file,
            )
            return
        ports = [s.getsockname()[1] for s in sockets]
        served: dict[int, fleet.ASGIApp] = {
            port: app.starlette() for port, app in zip(ports, apps, strict=False)
        }
        engines = [describe(app, port) for port, app in zip(ports, apps, strict=False)]
        top: dict[str, Any] = {}
        if controller:
            served[ports[-1]] = lmcache_controller(apps).starlette()
            top["lmcache_controller"] = f"http://{args.host}:{ports[-1]}"
        await serve_app(
            fleet.PortDispatch(served),
            args.host,
            ports[0],
            args.log_level,
            {},
            args.ready_file,
            on_started=lambda _port: {**engines[0], **top, "engines": engines},
            sockets=sockets,
        )

    from quillcache.serving import run_loop

    try:
        run_loop(serve())
    finally:
        for p in publishers:
            p.close()
        if hub is not None:
            hub.close()
    return 0
