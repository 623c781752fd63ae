"""SLO admission under overload (issue 19 §3), side by side in one run:

    python -m benchmarks.online.bench_slo [--engines 2] [--prompt-tokens 2000] \\
        [--overload 2.0] [--duration 30] [--slo-ms 1000] [--seed 0] [--json out.json] \\
        [--modes admission,none] [--router quillcache]

The same open-loop load (Poisson arrivals at `--overload` times the fleet's prefill
capacity, every prompt distinct so no cache hit lightens it) goes through a fresh
gateway in front of fresh engine simulators twice:
- "admission": every request carries `x-slo-ttft-ms: --slo-ms`; the control plane's
  admission stage refuses (429 + Retry-After) what the chosen engine cannot meet;
- "none": the same requests without the header (no default SLO): all are served;
- "queue" (with `--modes`): as "admission", with `slo_admission: queue`; every other
  request carries vLLM's `priority: 1` (the others 0: sooner), and the report splits
  by priority.
TTFT is measured at the client: the first streamed chunk of the official `openai`
client's completion. Reported per run: requests sent, served, refused, the share of
served requests that met the SLO (target with admission: >= 95 %), TTFT p50/p99 of the
served ones and goodput (requests meeting the SLO per second of arrivals).

Capacity is the cost model's (the engine simulator runs the same default model): an
engine prefills one `--prompt-tokens` prompt in `prefill_time(prompt)`, so the fleet
serves `engines / prefill_time` prompts per second; the decode of `--max-tokens`
output tokens rides along in the same steps. The "none" run's served rate shows what
the fleet really did. Run from the repo root.
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

import numpy as np
import openai

from quillcache.costmodel import CostModel
from quillcache.up import stack


@dataclass
class Outcome:
    sent_s: float
    priority: int = 0
    ttft_s: float | None = None  # None: not served
    status: int = 200
    retry_after_s: int | None = None
    error: str = ""


@dataclass
class RunReport:
    mode: str
    sent: int = 0
    served: int = 0
    refused: int = 0
    failed: int = 0
    met_slo: int = 0
    share_served_meeting_slo: float = 0.0
    ttft_p50_s: float = 0.0
    ttft_p99_s: float = 0.0
    goodput_rps: float = 0.0
    served_rps: float = 0.0
    retry_after_p50_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def _prompt(rng: random.Random, tokens: int) -> str:
    head = "".join(rng.choices(string.ascii_letters, k=32))  # a distinct first block
    filler = "the quick brown fox jumps over the lazy dog " * (tokens // 40 + 1)
    return (head + filler)[:tokens]


async def _one(
    client: openai.AsyncOpenAI,
    prompt: str,
    at_s: float,
    start: float,
    headers: dict[str, str],
    max_tokens: int,
    priority: int | None,
) -> Outcome:
    await asyncio.sleep(max(0.0, start + at_s - time.perf_counter()))
    sent = time.perf_counter()
    out = Outcome(sent_s=sent - start, priority=priority or 0)
    try:
        stream = await client.completions.create(
            model="sim-model",
            prompt=prompt,
            max_tokens=max_tokens,
            stream=True,
            extra_headers=headers,
            extra_body={} if priority is None else {"priority": priority},
        )
        async for chunk in stream:
            if out.ttft_s is None and chunk.choices:
                out.ttft_s = time.perf_counter() - sent
    except openai.RateLimitError as exc:
        out.status = 429
        out.retry_after_s = int(exc.response.headers.get("retry-after", "0"))
    except openai.APIStatusError as exc:
        out.status = exc.status_code
        out.error = exc.message[:120]
        out.ttft_s = None
    except openai.APIError as exc:  # no answer at all (connection, timeout)
        out.status = 599
        out.error = f"{type(exc).__name__}: {exc}"[:120]
        out.ttft_s = None
    return out


async def _load(
    url: str,
    arrivals: list[float],
    prompts: list[str],
    headers: dict[str, str],
    max_tokens: int,
    priorities: bool,
) -> list[Outcome]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="bench", max_retries=0, timeout=600.0)
    start = time.perf_counter()
    try:
        return await asyncio.gather(
            *(
                _one(client, p, t, start, headers, max_tokens, i % 2 if priorities else None)
                for i, (t, p) in enumerate(zip(arrivals, prompts, strict=True))
            )
        )
    finally:
        await client.close()


def _report(mode: str, outcomes: list[Outcome], slo_s: float, span_s: float) -> RunReport:
    r = RunReport(mode=mode, sent=len(outcomes))
    ttfts = np.array([o.ttft_s for o in outcomes if o.ttft_s is not None])
    r.served = len(ttfts)
    r.refused = sum(o.status == 429 for o in outcomes)
    r.failed = r.sent - r.served - r.refused
    r.met_slo = int((ttfts <= slo_s).sum()) if len(ttfts) else 0
    if len(ttfts):
        r.share_served_meeting_slo = r.met_slo / r.served
        r.ttft_p50_s = float(np.percentile(ttfts, 50))
        r.ttft_p99_s = float(np.percentile(ttfts, 99))
        served_at = [o.sent_s + o.ttft_s for o in outcomes if o.ttft_s is not None]
        r.served_rps = r.served / max(max(served_at), span_s)
    r.goodput_rps = r.met_slo / span_s
    failures: dict[str, int] = {}
    for o in outcomes:
        if o.ttft_s is None and o.status != 429:
            key = f"{o.status} {o.error}"
            failures[key] = failures.get(key, 0) + 1
    r.extra["failures"] = failures
    waits = [o.retry_after_s for o in outcomes if o.retry_after_s is not None]
    if waits:
        r.retry_after_p50_s = float(np.percentile(waits, 50))
    return r


def _run(
    mode: str, args: argparse.Namespace, arrivals: list[float], prompts: list[str]
) -> RunReport:
    with tempfile.TemporaryDirectory(prefix=f"bench-slo-{mode}-") as tmp:
        config = Path(tmp) / "gateway.json"
        config.write_text(
            json.dumps(
                {
                    "tokenizer": "builtin",
                    "router": args.router,
                    "relay": "native",
                    "secret_file": str(Path(tmp) / "secret.json"),
                    # queued answers come late under overload: not hung engines
                    "first_byte_timeout_s": 600,
                    "stall_timeout_s": 600,
                    "slo_admission": "queue" if mode == "queue" else "reject",
                    "slo_queue_tick_s": args.queue_tick_ms / 1000.0,
                }
            )
        )
        headers = {"x-slo-ttft-ms": str(args.slo_ms)} if mode != "none" else {}
        with stack(args.engines, workdir=Path(tmp), gateway_extra=["--config", str(config)]) as (
            _,
            gateway,
        ):
            outcomes = asyncio.run(
                _load(gateway.url, arrivals, prompts, headers, args.max_tokens, mode == "queue")
            )
    report = _report(mode, outcomes, args.slo_ms / 1000.0, args.duration)
    if mode == "queue":
        report.extra["by_priority"] = {
            p: asdict(
                _report(
                    f"queue p{p}",
                    [o for o in outcomes if o.priority == p],
                    args.slo_ms / 1000.0,
                    args.duration,
                )
            )
            for p in (0, 1)
        }
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--overload", type=float, default=2.0)
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals")
    ap.add_argument("--slo-ms", type=float, default=1000.0)
    ap.add_argument("--router", default="quillcache")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", default="admission,none", help="of admission, queue, none")
    ap.add_argument("--queue-tick-ms", type=float, default=10.0, help="slo_queue_tick_s, in ms")
    args = ap.parse_args()

    prefill_s = CostModel().prefill_time(args.prompt_tokens, 0)
    capacity = args.engines / prefill_s
    rate = args.overload * capacity
    rng = random.Random(args.seed)
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= args.duration:
            break
        arrivals.append(t)
    prompts = [_prompt(rng, args.prompt_tokens) for _ in arrivals]
    print(
        f"{args.engines} engines, prompt {args.prompt_tokens} tokens (prefill {prefill_s:.3f} s): "
        f"capacity {capacity:.1f} req/s, offered {rate:.1f} req/s ({args.overload:g}x) for "
        f"{args.duration:g} s = {len(arrivals)} requests; TTFT SLO {args.slo_ms:g} ms"
    )
    reports = [_run(mode, args, arrivals, prompts) for mode in args.modes.split(",")]
    for r in reports:
        print(
            f"{r.mode:>9}: sent {r.sent}, served {r.served}, refused {r.refused}, failed "
            f"{r.failed}; served meeting SLO {r.met_slo}/{r.served} = "
            f"{100 * r.share_served_meeting_slo:.1f} %; TTFT p50 {r.ttft_p50_s:.3f} s p99 "
            f"{r.ttft_p99_s:.3f} s; goodput {r.goodput_rps:.2f} req/s; served "
            f"{r.served_rps:.2f} req/s; Retry-After p50 {r.retry_after_p50_s:g} s"
        )
        for what, n in r.extra["failures"].items():
            print(f"{'':>11}{n} failed: {what}")
        for p, sub in r.extra.get("by_priority", {}).items():
            print(
                f"{'':>11}priority {p}: sent {sub['sent']}, served {sub['served']}, refused "
                f"{sub['refused']}; meeting SLO {sub['met_slo']}/{sub['served']}; goodput "
                f"{sub['goodput_rps']:.2f} req/s; TTFT p99 {sub['ttft_p99_s']:.3f} s"
            )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "capacity_rps": capacity,
                    "offered_rps": rate,
                    "runs": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
