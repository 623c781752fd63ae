"""Sending the workload: N concurrent clients, or arrivals at a rate / trace times.

aiohttp rather than httpx: the client must not be the bottleneck it measures (httpx's
pool scan made a 64-connection client CPU-bound well before the servers were).

Timing per request: TTFT = first content chunk (streaming) or the whole answer (not
streaming), inter-token latency = gaps between content chunks, end-to-end = last byte.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from quillcache.loadgen.workload import LoadRequest


@dataclass
class Sample:
    ok: bool
    status: int = 0
    error: str = ""
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    worker: str = ""


@dataclass
class RunConfig:
    url: str
    model: str | None = None
    chat: bool = False
    stream: bool = True
    concurrency: int = 16
    rate: float | None = None  # requests/s (Poisson); None = closed loop at `concurrency`
    use_arrivals: bool = False  # trace timestamps
    api_key: str | None = None
    timeout_s: float = 120.0
    seed: int = 0
    # The first `warmup` requests open the connections and fill the pipeline: sent in
    # the same session, not measured. Without it a closed loop at 64 streams measures
    # its own start (64 connections and requests at once, tens of ms of queueing).
    warmup: int = 0


def _body(cfg: RunConfig, req: LoadRequest) -> dict[str, object]:
    body: dict[str, object] = {"max_tokens": req.max_tokens, "stream": cfg.stream}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _usage(sample: Sample, data: dict[str, object]) -> None:
    usage = data.get("usage")
    if isinstance(usage, dict):
        sample.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        sample.output_tokens = int(usage.get("completion_tokens") or sample.output_tokens)
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict):
            sample.cached_tokens = int(details.get("cached_tokens") or 0)


async def one_request(client: aiohttp.ClientSession, cfg: RunConfig, req: LoadRequest) -> Sample:
    path = "/v1/chat/completions" if cfg.chat else "/v1/completions"
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    if req.session:
        headers["x-session-id"] = req.session
    start = time.perf_counter()
    sample = Sample(ok=False)
    try:
        async with client.post(cfg.url + path, json=_body(cfg, req), headers=headers) as resp:
            sample.status = resp.status
            sample.worker = resp.headers.get("x-quillcache-worker", "")
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                sample.error = f"HTTP {resp.status}: {text[:200]}"
                sample.e2e_s = time.perf_counter() - start
                return sample
            if not cfg.stream:
                data = json.loads(await resp.read())
                sample.e2e_s = sample.ttft_s = time.perf_counter() - start
                _usage(sample, data)
                sample.ok = True
                return sample
            last = 0.0
            done = False
            async for raw in resp.content:  # one SSE line at a time
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                data = json.loads(payload)
                if "error" in data:
                    sample.error = f"stream error: {data['error']}"
                    return sample
                now = time.perf_counter() - start
                choices = data.get("choices") or []
                text = ""
                if choices:
                    c = choices[0]
                    text = c.get("text") or (c.get("delta") or {}).get("content") or ""
                if text:
                    if sample.output_tokens == 0:
                        sample.ttft_s = now
                    else:
                        sample.itl_s.append(now - last)
                    last = now
                    sample.output_tokens += 1
                _usage(sample, data)
            sample.e2e_s = time.perf_counter() - start
            sample.ok = done
            if not done:
                sample.error = "stream ended without [DONE]"
            return sample
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        sample.error = f"{type(exc).__name__}: {exc}"[:200]
        sample.e2e_s = time.perf_counter() - start
        return sample
    except (AttributeError, TypeError, KeyError, IndexError) as exc:
        # JSON of another shape than OpenAI's (a list, a choice that is not an object):
        # this request failed, the run goes on
        sample.error = f"malformed answer: {type(exc).__name__}: {exc}"[:200]
        sample.e2e_s = time.perf_counter() - start
        return sample


async def run_load(
    cfg: RunConfig,
    requests: Sequence[LoadRequest],
    progress: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], float]:
    """Send every request; returns the samples of all but the first `cfg.warmup` (in
    completion order) and the wall time from the first measured request on."""
    connector = aiohttp.TCPConnector(limit=cfg.concurrency, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=cfg.timeout_s, sock_connect=10.0)
    samples: list[Sample] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        started = time.perf_counter()
        measured_from: float | None = None

        async def send(i: int, req: LoadRequest) -> None:
            nonlocal measured_from
            if i >= cfg.warmup and measured_from is None:
                measured_from = time.perf_counter()
            s = await one_request(client, cfg, req)
            if i < cfg.warmup:
                return
            samples.append(s)
            if progress is not None:
                progress(s)

        if cfg.rate is None and not cfg.use_arrivals:
            queue: asyncio.Queue[tuple[int, LoadRequest]] = asyncio.Queue()
            for item in enumerate(requests):
                queue.put_nowait(item)

            async def worker() -> None:
                while not queue.empty():
                    await send(*queue.get_nowait())

            await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
        else:
            rng = random.Random(cfg.seed)
            gate = asyncio.Semaphore(max(cfg.concurrency, 1))
            tasks = []
            t = 0.0
            for i, r in enumerate(requests):
                if cfg.use_arrivals:
                    t = r.arrival_s
                else:
                    assert cfg.rate is not None
                    t += rng.expovariate(cfg.rate)
                delay = started + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)

                async def bounded(i: int = i, req: LoadRequest = r) -> None:
                    async with gate:
                        await send(i, req)

                tasks.append(asyncio.create_task(bounded()))
            await asyncio.gather(*tasks)
        return samples, time.perf_counter() - (measured_from or started)
