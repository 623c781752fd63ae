"""Session retention for agents that pause for tools (issue 19 §3), side by side:

    python -m benchmarks.online.bench_retention [--engines 2] [--gpu-blocks 384] \\
        [--sessions 6] [--turns 4] [--tool-wait 6,10] [--background-rps 8] \\
        [--seed 0] [--json out.json] [--modes retention,none]

Agent sessions talk to the gateway in turns: each turn's prompt is the previous one
plus the tool's output, and between turns the agent waits for its tool
(`--tool-wait` seconds, uniform). Meanwhile background requests with fresh prompts
(`--background-rps`, Poisson, 16 blocks each) go through the same gateway and fill
the engines' small caches (`--gpu-blocks` each), so an engine's LRU turns over well
within one tool wait. Both runs send the same requests with the same session id
(`x-session-id`); the "retention" run adds `x-session-ttl-s`, which makes the policy
engine keep each session's prefix warm on its engine and route its next turn there.

Reported per run: the next-turn hit rate (tokens of the previous turn's prompt the
engine served from its cache, over those tokens: vLLM's `usage.prompt_tokens_details.
cached_tokens` as the engine simulator reports it), the share of next turns that hit
all of it, their TTFT (p50/p99, first streamed chunk at the client), and the prefill
tokens the policy engine spent on its warm requests (the gateway's
`quillcache_policy_prefill_tokens_total`) against the tokens the sessions sent.
Run from the repo root.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai

from benchmarks.online.prom import metric
from quillcache.up import stack

BLOCK = 16  # the engine simulator's default; builtin tokenizer: a token per byte


@dataclass
class Turn:
    session: int
    turn: int
    prompt_tokens: int
    previous_tokens: int  # whole-block tokens of the previous turn's prompt (0: first)
    cached_tokens: int = 0
    ttft_s: float | None = None
    error: str = ""


@dataclass
class RunReport:
    mode: str
    next_turns: int = 0
    hit_rate: float = 0.0
    full_hits: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    session_tokens: int = 0
    background_requests: int = 0
    warm_prefill_tokens: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choices(string.ascii_letters + " ", k=tokens))


async def _complete(
    client: openai.AsyncOpenAI, prompt: str, headers: dict[str, str]
) -> tuple[int, float]:
    """Cached tokens and TTFT of one streamed completion."""
    sent = time.perf_counter()
    ttft: float | None = None
    cached = 0
    stream = await client.completions.create(
        model="sim-model",
        prompt=prompt,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
    )
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - sent
        usage = chunk.usage
        if usage is not None and usage.prompt_tokens_details is not None:
            cached = usage.prompt_tokens_details.cached_tokens or 0
    return cached, ttft if ttft is not None else time.perf_counter() - sent


async def _session(
    client: openai.AsyncOpenAI, s: int, args: argparse.Namespace, retain: bool, seed: int
) -> list[Turn]:
    rng = random.Random(seed * 1000 + s)
    prompt = f"agent {s:03d} " + _text(rng, args.first_blocks * BLOCK - 10)
    headers = {"x-session-id": f"agent-{s}"}
    if retain:
        headers["x-session-ttl-s"] = str(args.session_ttl_s)
    lo, hi = args.tool_wait
    turns: list[Turn] = []
    previous = 0
    await asyncio.sleep(rng.uniform(0, hi))  # the sessions start spread out
    for k in range(args.turns):
        t = Turn(s, k, len(prompt), previous)
        try:
            t.cached_tokens, t.ttft_s = await _complete(client, prompt, headers)
        except openai.APIError as exc:
            t.error = f"{type(exc).__name__}: {exc}"[:120]
        turns.append(t)
        previous = len(prompt) // BLOCK * BLOCK
        await asyncio.sleep(rng.uniform(lo, hi))  # the tool runs
        prompt += " tool: " + _text(rng, args.turn_blocks * BLOCK - 7)
    return turns


async def _background(
    client: openai.AsyncOpenAI, args: argparse.Namespace, seed: int, stop: asyncio.Event
) -> int:
    rng = random.Random(seed + 7)
    sent = 0
    tasks: set[asyncio.Task[Any]] = set()
    while not stop.is_set():
        await asyncio.sleep(rng.expovariate(args.background_rps))
        prompt = f"bg {sent:06d} " + _text(rng, 16 * BLOCK - 10)
        task = asyncio.ensure_future(_complete(client, prompt, {}))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        sent += 1
    await asyncio.gather(*tasks, return_exceptions=True)
    return sent


async def _load(url: str, args: argparse.Namespace, retain: bool) -> tuple[list[Turn], int]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=120)
    stop = asyncio.Event()
    try:
        background = asyncio.ensure_future(_background(client, args, args.seed, stop))
        sessions = await asyncio.gather(
            *(_session(client, s, args, retain, args.seed) for s in range(args.sessions))
        )
        stop.set()
        sent = await background
    finally:
        await client.close()
    return [t for turns in sessions for t in turns], sent


def _run(mode: str, args: argparse.Namespace) -> RunReport:
    with tempfile.TemporaryDirectory(prefix=f"bench-retention-{mode}-") as tmp:
        config = Path(tmp) / "gateway.json"
        config.write_text(
            json.dumps(
                {
                    "tokenizer": "builtin",
                    "router": args.router,
                    "relay": "native",
                    "secret_file": str(Path(tmp) / "secret.json"),
                }
            )
        )
        with stack(
            args.engines,
            workdir=Path(tmp),
            engine_extra=["--num-gpu-blocks", str(args.gpu_blocks)],
            gateway_extra=["--config", str(config)],
        ) as (_, gateway):
            turns, background = asyncio.run(_load(gateway.url, args, mode == "retention"))
            page = httpx.get(gateway.url + "/metrics").text
    report = RunReport(mode=mode, background_requests=background)
    nexts = [t for t in turns if t.previous_tokens and not t.error]
    report.next_turns = len(nexts)
    report.session_tokens = sum(t.prompt_tokens for t in turns)
    if nexts:
        hit = [min(t.cached_tokens, t.previous_tokens) for t in nexts]
        report.hit_rate = sum(hit) / sum(t.previous_tokens for t in nexts)
        report.full_hits = sum(
            h >= t.previous_tokens for h, t in zip(hit, nexts, strict=True)
        ) / len(nexts)
        ttfts = np.array([t.ttft_s for t in nexts if t.ttft_s is not None])
        report.ttft_p50_s = float(np.percentile(ttfts, 50))
        report.ttft_p99_s = float(np.percentile(ttfts, 99))
    report.warm_prefill_tokens = metric(page, "quillcache_policy_prefill_tokens_total")
    report.extra["warm_requests"] = {
        line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in page.splitlines()
        if line.startswith("quillcache_policy_warm_requests_total{")
    }
    report.extra["errors"] = [t.error for t in turns if t.error]
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--gpu-blocks", type=int, default=384, help="each engine's cache")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-blocks", type=int, default=24, help="a session's first prompt")
    ap.add_argument("--turn-blocks", type=int, default=3, help="what each tool adds")
    ap.add_argument(
        "--tool-wait",
        type=lambda v: tuple(float(x) for x in v.split(",")),
        default=(6.0, 10.0),
        help="seconds, uniform between the two",
    )
    ap.add_argument("--background-rps", type=float, default=8.0)
    ap.add_argument("--session-ttl-s", type=float, default=120.0)
    ap.add_argument("--router", default="quillcache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="retention,none")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reports = [_run(mode, args) for mode in args.modes.split(",")]
    for r in reports:
        share = r.warm_prefill_tokens / max(r.session_tokens, 1)
        print(
            f"{r.mode:>9}: {r.next_turns} next turns: hit rate {r.hit_rate:.3f}, whole "
            f"previous prompt cached {100 * r.full_hits:.0f} %; TTFT p50 {r.ttft_p50_s:.3f} s "
            f"p99 {r.ttft_p99_s:.3f} s; {r.background_requests} background requests; warm "
            f"prefill {r.warm_prefill_tokens:.0f} tokens ({100 * share:.1f} % of the sessions' "
            f"{r.session_tokens} prompt tokens)"
        )
        for e in r.extra["errors"]:
            print(f"{'':>11}error: {e}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
