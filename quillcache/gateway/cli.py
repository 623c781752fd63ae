"""`quillcache gateway`: run the OpenAI-compatible routing gateway."""

from __future__ import annotations

import argparse
import os
import sys

ADMIN_TOKEN_ENV = "QUILLCACHE_ADMIN_TOKEN"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--config", default=None, help="YAML / TOML / JSON config file (flags override it)")
    a("--host", default=None, help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=None, help="0: any free port (see --ready-file)")
    a(
        "--worker",
        action="append",
        default=None,
        metavar="URL",
        help="an engine's base URL (repeatable); its KV events are discovered",
    )
    a("--router", default=None, help="a registered router name or 'pkg.module:Class'")
    a("--index", default=None, help="index backend name (native, memory, ...)")
    a("--tokenizer", default=None, help="'engine', 'builtin' or a tokenizer.json path")
    a("--block-size", type=int, default=None, help="KV block size in tokens (default: ask engines)")
    a(
        "--admin-token",
        default=None,
        help=f"bearer token of the /admin API (else ${ADMIN_TOKEN_ENV}; none: the API is off)",
    )
    a(
        "--api-key",
        action="append",
        default=None,
        dest="api_keys",
        help="an accepted API key, no tenant (repeatable; the config maps hashed keys to tenants)",
    )
    a(
        "--no-parity-check",
        action="store_true",
        help="skip the start-up check that the engines' events match the gateway's keys",
    )
    a(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="default warning",
    )
    a(
        "--state",
        default=None,
        help="'local' (default) or 'redis://host:port/db': replicas of one fleet share their "
        "booked load and admin changes through Redis",
    )
    a("--state-prefix", default=None, help="the fleet's key prefix in Redis (default quillcache)")
    a("--secret-file", default=None, help="the gateway secret (identical on every replica)")
    a(
        "--bootstrap-from",
        action="append",
        default=None,
        metavar="URL",
        help="a peer replica's base URL (repeatable): load its index snapshot at start-up, "
        "before subscribing (its admin token: bootstrap_token, else --admin-token)",
    )
    a(
        "--advertise-url",
        default=None,
        help="the URL peers reach this replica at (--state redis advertises it while ready)",
    )
    a("--ready-file", default=None, help="write the resolved URL here as JSON when up")


def run(args: argparse.Namespace) -> int:
    import logging

    from quillcache.errors import ConfigError, QuillCacheError
    from quillcache.gateway.config import load_config

    try:
        config = load_config(
            args.config,
            host=args.host,
            port=args.port,
            workers=[{"url": u} for u in args.worker] if args.worker else None,
            router=args.router,
            index=args.index,
            tokenizer=args.tokenizer,
            block_size=args.block_size,
            admin_token=args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None,
            api_keys=args.api_keys,
            parity_check=False if args.no_parity_check else None,
            log_level=args.log_level,
            state=args.state,
            state_prefix=args.state_prefix,
            secret_file=args.secret_file,
            bootstrap_from=args.bootstrap_from,
            advertise_url=args.advertise_url,
        )
    except ConfigError as exc:
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from quillcache.gateway.serve import serve_gateway

    try:
        serve_gateway(config, ready_file=args.ready_file)
    except QuillCacheError as exc:  # config, unknown router/backend, engine discovery
        print(f"gateway: {exc}", file=sys.stderr)
        return 2
    return 0
