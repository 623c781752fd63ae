"""The `quillcache` command. Each subcommand lives in its part's package and is
imported only when used, so `quillcache --help` stays fast and a missing optional
dependency only affects the subcommand that needs it."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Sequence

# name -> (module with `add_arguments(parser)` and `run(args) -> int`, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("quillcache.sim.cli", "replay a workload over routers x index backends"),
    "bench-index": ("quillcache.bench.index_cli", "benchmark index backends side by side"),
    "bench-route": (
        "quillcache.bench.route_cli",
        "time routing decisions per router and fleet size",
    ),
    "gateway": ("quillcache.gateway.cli", "run the OpenAI-compatible routing gateway"),
    "secret": ("quillcache.gateway.secret_cli", "show or rotate the gateway secret; hash API keys"),
    "engine-sim": ("quillcache.enginesim.cli", "run a simulated vLLM engine"),
    "up": (
        "quillcache.up",
        "start simulated engines and a gateway (or, with --replicas, gateway replicas "
        "sharing a redis-server) on 127.0.0.1",
    ),
    "loadgen": ("quillcache.loadgen.cli", "replay a workload against an OpenAI endpoint"),
}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package does not exist (yet)
        return False


def _available() -> dict[str, tuple[str, str]]:
    return {name: spec for name, spec in SUBCOMMANDS.items() if _importable(spec[0])}


def build_parser() -> argparse.ArgumentParser:
    from quillcache import __version__

    parser = argparse.ArgumentParser(
        prog="quillcache", description="KV-cache control plane for LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"quillcache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in _available().items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from quillcache.errors import QuillCacheError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except QuillCacheError as exc:  # a user error: say what, no traceback
        print(f"quillcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
