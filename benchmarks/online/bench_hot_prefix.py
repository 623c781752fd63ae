"""Hot-prefix replication (issue 19 §3), side by side in one run:

    python -m benchmarks.online.bench_hot_prefix [--engines 4] [--max-num-seqs 4] \\
        [--rps 24] [--duration 20] [--prefix-blocks 48] [--router sglang] \\
        [--seed 0] [--json out.json] [--modes replicate,none]

One popular system prompt (`--prefix-blocks` blocks) starts every request, each with a
short question of its own; `--rps` x `--duration` requests arrive as a Poisson process
(the same schedule in every run), above what the one engine holding the prompt serves
with its `--max-num-seqs` sequence slots. The router follows the prefix cache
(`--router`, SGLang's cache-aware policy by default: the longest match wins unless
requests in flight are imbalanced by 64), so without replication the prompt's requests
queue on its holder while the other engines idle; with `policy.replication` the policy
engine copies the prompt onto idle engines, and the router then picks the shorter queue
among equal matches.

Reported per run: TTFT p50/p99 (first streamed chunk at the client), the prefill tokens
the engines computed (the sum of prompt tokens not served from cache, by the engines'
own `cached_tokens`, plus the policy engine's warm-request tokens from the gateway's
`quillcache_policy_prefill_tokens_total`), and the share of them the warm requests were.
The replicate run's extra prefill is its total over the other run's. Run from the repo
root.
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
class RunReport:
    mode: str
    requests: int = 0
    errors: int = 0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    prompt_tokens: int = 0
    request_prefill_tokens: int = 0  # prompt tokens the engines did not have cached
    warm_prefill_tokens: float = 0.0
    replicas: float = 0.0
    by_engine: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prefill_tokens(self) -> float:
        return self.request_prefill_tokens + self.warm_prefill_tokens


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choices(string.ascii_letters + " ", k=tokens))


async def _one(
    client: openai.AsyncOpenAI, prompt: str, max_tokens: int
) -> tuple[float, int, int, str]:
    """TTFT, prompt tokens, cached tokens and the serving engine of one streamed request."""
    sent = time.perf_counter()
    ttft: float | None = None
    prompt_tokens = cached = 0
    raw = await client.completions.with_raw_response.create(
        model="sim-model",
        prompt=prompt,
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    )
    worker = raw.headers.get("x-quillcache-worker", "?")
    async for chunk in raw.parse():
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - sent
        usage = chunk.usage
        if usage is not None:
            prompt_tokens = usage.prompt_tokens
            if usage.prompt_tokens_details is not None:
                cached = usage.prompt_tokens_details.cached_tokens or 0
    return (ttft if ttft is not None else time.perf_counter() - sent), prompt_tokens, cached, worker


async def _load(url: str, args: argparse.Namespace) -> list[tuple[float, int, int, str] | str]:
    rng = random.Random(args.seed)
    system = "system " + _text(rng, args.prefix_blocks * BLOCK - 7)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=300)
    tasks: list[asyncio.Task[tuple[float, int, int, str]]] = []
    try:
        # the prompt is placed on one engine first, as a popular prompt would be
        await _one(client, system + " warm", 1)
        # the same arrivals in every run: a fixed schedule, not a clock-bounded loop
        at, schedule = 0.0, []
        for i in range(round(args.rps * args.duration)):
            at += rng.expovariate(args.rps)
            question = f" question {i:05d} " + _text(rng, args.question_blocks * BLOCK)
            schedule.append((at, system + question))
        start = time.perf_counter()
        for at, prompt in schedule:
            await asyncio.sleep(max(at - (time.perf_counter() - start), 0.0))
            tasks.append(asyncio.ensure_future(_one(client, prompt, args.max_tokens)))
        done = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await client.close()
    return [d if not isinstance(d, BaseException) else f"{type(d).__name__}: {d}" for d in done]


def _run(mode: str, args: argparse.Namespace) -> RunReport:
    with tempfile.TemporaryDirectory(prefix=f"bench-hot-prefix-{mode}-") as tmp:
        config = Path(tmp) / "gateway.json"
        config.write_text(
            json.dumps(
                {
                    "tokenizer": "builtin",
                    "router": args.router,
                    "relay": "native",
                    "secret_file": str(Path(tmp) / "secret.json"),
                    "policy": {
                        "interval_s": 0.2,
                        "replication": {"enabled": mode == "replicate"},
                    },
                }
            )
        )
        with stack(
            args.engines,
            workdir=Path(tmp),
            engine_extra=["--max-num-seqs", str(args.max_num_seqs)],
            gateway_extra=["--config", str(config)],
        ) as (_, gateway):
            results = asyncio.run(_load(gateway.url, args))
            page = httpx.get(gateway.url + "/metrics").text
    report = RunReport(mode=mode)
    ok = [r for r in results if not isinstance(r, str)]
    report.requests = len(results)
    report.errors = len(results) - len(ok)
    report.extra["errors"] = sorted({r for r in results if isinstance(r, str)})[:5]
    if ok:
        ttfts = np.array([r[0] for r in ok])
        report.ttft_p50_s = float(np.percentile(ttfts, 50))
        report.ttft_p99_s = float(np.percentile(ttfts, 99))
    report.prompt_tokens = sum(r[1] for r in ok)
    report.request_prefill_tokens = sum(max(r[1] - r[2], 0) for r in ok)
    for r in ok:
        report.by_engine[r[3]] = report.by_engine.get(r[3], 0) + 1
    report.warm_prefill_tokens = metric(page, "quillcache_policy_prefill_tokens_total")
    report.replicas = metric(
        page, 'quillcache_policy_warm_requests_total{action="replicate",outcome="ok"'
    )
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=4, help="each engine's sequence slots")
    ap.add_argument("--rps", type=float, default=24.0, help="arrivals a second (Poisson)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    ap.add_argument("--prefix-blocks", type=int, default=48, help="the popular prompt")
    ap.add_argument("--question-blocks", type=int, default=2, help="each request's own part")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--router", default="sglang")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", default="replicate,none")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    reports = [_run(mode, args) for mode in args.modes.split(",")]
    base = {r.mode: r for r in reports}.get("none")
    for r in reports:
        share = r.warm_prefill_tokens / max(r.prefill_tokens, 1)
        line = (
            f"{r.mode:>9}: {r.requests} requests ({r.errors} failed); TTFT p50 "
            f"{r.ttft_p50_s:.3f} s p99 {r.ttft_p99_s:.3f} s; prefill {r.prefill_tokens:.0f} "
            f"tokens ({r.warm_prefill_tokens:.0f} warm, {100 * share:.1f} %; {r.replicas:.0f} "
            f"replicas); by engine {dict(sorted(r.by_engine.items()))}"
        )
        if base is not None and r is not base and base.prefill_tokens:
            extra = r.prefill_tokens / base.prefill_tokens - 1
            drop = 1 - r.ttft_p99_s / base.ttft_p99_s if base.ttft_p99_s else 0.0
            line += f"; vs none: TTFT p99 {100 * drop:.0f} % lower, prefill {100 * extra:+.1f} %"
        print(line)
        for e in r.extra["errors"]:
            print(f"{'':>11}error: {e}")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "runs": [asdict(r) | {"prefill_tokens": r.prefill_tokens} for r in reports],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
