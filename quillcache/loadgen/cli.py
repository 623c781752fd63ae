"""`quillcache loadgen`: load an OpenAI endpoint (or several, side by side)."""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--url",
        action="append",
        required=True,
        help="base URL of an OpenAI endpoint; repeat to compare targets side by side",
    )
    a("--name", action="append", default=None, help="label per --url (default: the URL)")
    a("--model", default=None, help="the requests' model (default: none; the engine's own)")
    a("--chat", action="store_true", help="use /v1/chat/completions")
    a("--no-stream", action="store_true", help="non-streaming requests")
    a("--concurrency", type=int, default=16, help="requests in flight at once (closed loop)")
    a("--rate", type=float, default=None, help="requests/s (Poisson) instead of closed loop")
    a("--requests", type=int, default=200, help="how many requests to send")
    a(
        "--warmup",
        type=int,
        default=0,
        help="requests sent first, in the same session (connections open, pipeline full), "
        "and not measured",
    )
    a("--max-tokens", type=int, default=16, help="max_tokens of each request")
    a("--prefixes", type=int, default=8, help="synthetic: shared prefixes")
    a("--prefix-chars", type=int, default=1024, help="synthetic: length of the shared prefixes")
    a("--suffix-chars", type=int, default=64, help="synthetic: length of each unique tail")
    a("--trace", default=None, help="a Mooncake-format JSONL trace instead of synthetic")
    a("--trace-block-chars", type=int, default=64, help="text per trace hash id")
    a("--trace-timing", action="store_true", help="send at the trace's timestamps")
    a("--trace-time-scale", type=float, default=1.0, help="trace: multiply its arrival times")
    a("--api-key", default=None, help="sent as Authorization: Bearer <key>")
    a("--seed", type=int, default=0, help="seed of the synthetic workload")
    a("--json", default=None, metavar="PATH", help="write the results as JSON ('-' = stdout)")
    a("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from quillcache.errors import ConfigError
    from quillcache.loadgen.report import render_table, summarize
    from quillcache.loadgen.runner import RunConfig, run_load
    from quillcache.loadgen.workload import mooncake_trace, synthetic
    from quillcache.serving import run_loop

    console = Console(stderr=args.json == "-")
    names = args.name or []
    if len(names) not in (0, len(args.url)):
        print("loadgen: give one --name per --url", file=sys.stderr)
        return 2
    problem = _check_numbers(args) or _check_output(args.json, names or args.url)
    if problem:
        print(f"loadgen: {problem}", file=sys.stderr)
        return 2
    try:
        total = args.requests + args.warmup
        if args.trace:
            reqs = mooncake_trace(
                args.trace,
                requests=total,
                block_chars=args.trace_block_chars,
                max_tokens=args.max_tokens,
                time_scale=args.trace_time_scale,
            )
        else:
            reqs = synthetic(
                total,
                prefixes=args.prefixes,
                prefix_chars=args.prefix_chars,
                suffix_chars=args.suffix_chars,
                max_tokens=args.max_tokens,
                seed=args.seed,
            )
    except ConfigError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    measured = reqs[args.warmup :]
    results: dict[str, dict[str, object]] = {}
    for i, url in enumerate(args.url):
        name = names[i] if names else url
        cfg = RunConfig(
            url=url.rstrip("/"),
            model=args.model,
            chat=args.chat,
            stream=not args.no_stream,
            concurrency=args.concurrency,
            rate=args.rate,
            use_arrivals=args.trace_timing,
            api_key=args.api_key,
            seed=args.seed,
            warmup=args.warmup,
        )
        with Progress(console=console, transient=True, disable=args.no_progress) as progress:
            task = progress.add_task(f"{name}", total=len(measured))
            samples, wall = run_loop(
                run_load(cfg, reqs, functools.partial(_advance, progress, task))
            )
        results[name] = summarize(samples, wall)
    if args.json:
        text = json.dumps(results, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        mode = f"rate {args.rate}/s" if args.rate else f"concurrency {args.concurrency}"
        stream = "non-streaming" if args.no_stream else "streaming"
        console.print(render_table(results, f"loadgen: {len(measured)} requests, {mode}, {stream}"))
    return 1 if any(r["ok"] == 0 for r in results.values()) else 0


def _check_numbers(args: argparse.Namespace) -> str | None:
    """What is wrong with the run's numbers, or None (each names its flag and limit)."""
    if args.concurrency < 1:
        return "--concurrency must be at least 1"
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        return f"--rate must be a finite number of requests/s > 0, got {args.rate}"
    if args.warmup < 0:
        return f"--warmup must be >= 0, got {args.warmup}"
    if args.max_tokens < 1:
        return f"--max-tokens must be at least 1, got {args.max_tokens}"
    if not (math.isfinite(args.trace_time_scale) and args.trace_time_scale > 0):
        return f"--trace-time-scale must be a finite number > 0, got {args.trace_time_scale}"
    for flag, value in (
        ("--prefix-chars", args.prefix_chars),
        ("--suffix-chars", args.suffix_chars),
        ("--trace-block-chars", args.trace_block_chars),
    ):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    if args.trace and args.requests < 1:
        return f"--requests must be at least 1, got {args.requests}"
    return None


def _check_output(path: str | None, names: list[str]) -> str | None:
    """A --json that cannot be written, refused before the run (not after it), and
    labels that would overwrite each other's results."""
    if len(set(names)) < len(names):
        return "two targets have the same label: give each --url (or --name) once"
    if path is None or path == "-":
        return None
    if not path:
        return "--json needs a path ('-' for stdout)"
    target = Path(path)
    if target.is_dir():
        return f"--json {path} is a directory"
    if not target.parent.is_dir():
        return f"--json {path}: the directory {target.parent} does not exist"
    if not os.access(target.parent, os.W_OK) or (
        target.exists() and not os.access(target, os.W_OK)
    ):
        return f"--json {path} cannot be written"
    return None


def _advance(progress: Any, task: Any, sample: object) -> None:
    progress.advance(task)
