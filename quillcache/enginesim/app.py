"""vLLM's HTTP surface for the simulated engine (starlette).

Only what a gateway relies on (docs/kv-events.md): completions and chat (streaming
and not), /tokenize, /v1/models, /health, /metrics with vLLM's metric names,
/kv_event_sources and /reset_prefix_cache (SGLang: /flush_cache); plus /debug/*
fault injection for tests.
`flavor="sglang"` swaps the vLLM-only parts for SGLang's (`sglang.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import xxhash
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from quillcache.enginesim.engine import Admission, EngineConfig, EngineRequestError, SimEngine
from quillcache.enginesim.publisher import KvEventPublisher
from quillcache.enginesim.sglang import DEFAULT_RELEASE, SglangCollector, server_info
from quillcache.events.encode import BlockRemoved, BlockStored, encode_batch
from quillcache.tokenization.local import ByteTokenizer, Tokenizer
from quillcache.tokenization.media_fetch import MediaError
from quillcache.tokenization.multimodal import (
    MmBlocks,
    MultimodalConfig,
    MultimodalPrompts,
    MultimodalUnavailable,
    has_media,
)

FLAVORS = ("vllm", "sglang")  # whose HTTP surface the simulator serves


def error_response(status: int, message: str, kind: str = "BadRequestError") -> JSONResponse:
    """OpenAI's error shape, which the `openai` client turns into typed exceptions."""
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )


class _Body(BaseModel):
    """What vLLM's OpenAI server validates of a request (types, and SamplingParams'
    bounds: at least 1 token, a temperature of at least 0), and `n` of 1: the
    simulator answers one choice, so it refuses more rather than answer fewer."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    cache_salt: str | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str]


class ChatBody(_Body):
    messages: list[dict[str, Any]] = Field(min_length=1)

    @field_validator("messages")
    @classmethod
    def _roles(cls, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        # vLLM's message types: a role (a string) each, content a string, parts or none
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} has no 'role'")
            content = m.get("content")
            if content is not None and not isinstance(content, str | list):
                raise ValueError(f"message {i}: 'content' must be a string or a list of parts")
        return messages


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True


class _EngineCollector:
    """Reads the engine's state at scrape time, under vLLM's metric names."""

    def __init__(self, ranks: list[SimEngine]) -> None:
        self.ranks = ranks

    def collect(self) -> Iterator[Any]:
        ranks, labels = self.ranks, ["model_name", "engine"]  # one engine label per DP rank
        e = ranks[0]

        def family(kind: type[Any], name: str, doc: str, attr: str) -> Any:
            f = kind(name, doc, labels=labels)
            for r in ranks:
                f.add_metric([r.config.model, str(r.dp_rank)], float(getattr(r, attr)))
            return f

        yield family(
            GaugeMetricFamily,
            "vllm:num_requests_running",
            "Requests in model execution.",
            "running",
        )
        yield family(
            GaugeMetricFamily,
            "vllm:num_requests_waiting",
            "Requests waiting to be processed.",
            "waiting",
        )
        yield family(
            GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage, 1 = 100%.", "kv_usage"
        )
        yield family(
            CounterMetricFamily,
            "vllm:prefix_cache_queries",
            "Prefix-cache queries, in tokens.",
            "prefix_queries",
        )
        yield family(
            CounterMetricFamily,
            "vllm:prefix_cache_hits",
            "Prefix-cache hits, in tokens.",
            "prefix_hits",
        )
        done = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests, by finish reason (abort: the client went away).",
            labels=[*labels, "finished_reason"],
        )
        for r in ranks:
            done.add_metric([r.config.model, str(r.dp_rank), "length"], float(r.finished_total))
            done.add_metric([r.config.model, str(r.dp_rank), "abort"], float(r.aborted_total))
        yield done
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the cache config.",
            labels=[
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric(
            [
                str(e.config.block_size),
                str(e.config.num_gpu_blocks),
                "True",
                e.config.prefix_caching_hash_algo,
            ],
            1,
        )
        yield info


class EngineApp:
    """The simulated engine's state shared by the HTTP handlers."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None = None,
        publisher: KvEventPublisher | list[KvEventPublisher] | None = None,
        data_parallel_size: int = 1,
        flavor: str = "vllm",
    ) -> None:
        if flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {flavor!r}; known: {', '.join(FLAVORS)}")
        self.flavor = flavor
        if flavor == "sglang" and config.sglang_release is None:  # SGLang's events too
            config = dataclasses.replace(config, sglang_release=DEFAULT_RELEASE)
        self.config = config
        self.tokenizer = tokenizer or ByteTokenizer()
        if isinstance(publisher, list):
            self.publishers: list[KvEventPublisher | None] = list(publisher)
        else:
            self.publishers = [publisher]
        size = max(data_parallel_size, len(self.publishers))
        self.publishers += [None] * (size - len(self.publishers))
        self.publisher = self.publishers[0]  # rank 0's, for the /debug endpoints
        # one engine core per data-parallel rank, each publishing on its own socket
        self.ranks = [SimEngine(config, self._publisher_of(r), dp_rank=r) for r in range(size)]
        self.engine = self.ranks[0]
        self._next_rank = 0
        self.healthy = True
        self.flood_blocks = 0
        self._flooding = False
        self._flood_task: asyncio.Task[None] | None = None
        # path -> (answers still to fail, their status), set through /debug/fail
        self._failing: dict[str, tuple[int, int]] = {}
        self._registry = CollectorRegistry(auto_describe=True)
        collector = SglangCollector(self.ranks) if flavor == "sglang" else None
        self._registry.register(collector or _EngineCollector(self.ranks))
        self.models = [config.model, *config.lora_modules]
        self.multimodal = MultimodalPrompts(
            MultimodalConfig(hash_algorithm=config.mm_hasher_algorithm)
        )

    def _publisher_of(self, rank: int) -> Callable[[bytes], object]:
        pub = self.publishers[rank]
        return pub.publish if pub is not None else (lambda payload: None)

    def _pick_rank(self, request: Request) -> SimEngine | JSONResponse:
        """vLLM's `X-data-parallel-rank` header, else the least loaded rank (round robin
        among equals), as vLLM's internal DP load balancer does."""
        hint = request.headers.get("x-data-parallel-rank")
        if hint is not None:
            if not hint.isdigit() or int(hint) >= len(self.ranks):
                return error_response(400, f"x-data-parallel-rank must be 0..{len(self.ranks) - 1}")
            return self.ranks[int(hint)]
        n = len(self.ranks)
        order = [(self._next_rank + i) % n for i in range(n)]
        self._next_rank = (self._next_rank + 1) % n
        return self.ranks[min(order, key=lambda r: self.ranks[r].running + self.ranks[r].waiting)]

    # -- helpers -------------------------------------------------------------------------

    def _token_maker(self, prompt: list[int]) -> Callable[[int], int]:
        seed = xxhash.xxh3_64_intdigest(bytes(str(prompt[-64:]), "utf8"))
        if isinstance(self.tokenizer, ByteTokenizer):
            return lambda i: 97 + (seed + i * 7919) % 26  # a..z
        vocab = getattr(self.tokenizer, "vocab_size", 1000)
        return lambda i: 3 + (seed + i * 7919) % max(vocab - 3, 1)

    def _lora(self, model: str | None) -> tuple[str, JSONResponse | None]:
        if model in (None, "", self.config.model):
            return "", None
        if model in self.config.lora_modules:
            return model, None
        known = ", ".join(self.models)
        return "", error_response(
            404, f"The model `{model}` does not exist; known: {known}", "NotFoundError"
        )

    # -- handlers ------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def models_list(self, request: Request) -> Response:
        now = int(time.time())
        data = [
            {
                "id": m,
                "object": "model",
                "created": now,
                "owned_by": "quillcache-enginesim",
                "root": self.config.model,
                "parent": None if m == self.config.model else self.config.model,
                "max_model_len": self.config.max_model_len,
            }
            for m in self.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self._registry), media_type="text/plain; version=0.0.4")

    async def kv_event_sources(self, request: Request) -> Response:
        failed = self._injected_failure("/kv_event_sources")
        if failed is not None:
            return failed
        sources = [
            {
                "dp_rank": rank,
                "endpoint": p.endpoint,
                "replay_endpoint": p.replay_endpoint,
                "topic": p.topic.decode(),
                "engine_binds": p.binds,
            }
            for rank, p in enumerate(self.publishers)
            if p is not None
        ]
        return JSONResponse({"block_size": self.config.block_size, "sources": sources})

    async def server_info(self, request: Request) -> Response:
        """SGLang's server arguments (`--flavor sglang`), KV-event config included."""
        return JSONResponse(server_info(self.config, self.publishers))

    async def reset_prefix_cache(self, request: Request) -> Response:
        """vLLM's `POST /reset_prefix_cache` (served with VLLM_SERVER_DEV_MODE=1) and
        SGLang's `POST /flush_cache`: every rank drops its cached blocks (one
        AllBlocksCleared each); refused while requests run, as both engines do."""
        if not all([r.reset_prefix_cache() for r in self.ranks]):
            return error_response(400, "cannot reset the prefix cache while requests run")
        if self.flavor == "sglang":
            return Response("Cache flushed.\n", status_code=200)
        return Response(status_code=200)

    async def debug_drop_events(self, request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, Response):
            return body
        if self.publisher is None:
            return error_response(400, "this engine publishes no KV events")
        count = body.get("count")
        if not isinstance(count, int) or count < 0:
            return error_response(400, "'count' must be a non-negative integer")
        self.publisher.drop_next(count, forget=bool(body.get("forget", False)))
        return JSONResponse({"dropping": count, "next_seq": self.publisher.seq})

    async def debug_flood(self, request: Request) -> Response:
        """Publish synthetic BlockStored/BlockRemoved batches at `blocks_per_s` for
        `seconds` (an ingest load test of whoever subscribes; not part of vLLM). GET: the
        count so far; DELETE: stop the running flood."""
        if request.method == "GET":
            last_seq = self.publisher.seq - 1 if self.publisher is not None else -1
            return JSONResponse(
                {
                    "published_blocks": self.flood_blocks,
                    "running": self._flooding,
                    "last_seq": last_seq,  # of every batch published, flood or not
                }
            )
        if request.method == "DELETE":
            task, stopped = self._flood_task, False
            if task is not None and not task.done():
                task.cancel()
                stopped = True
            return JSONResponse({"stopped": stopped, "published_blocks": self.flood_blocks})
        body = await _json(request)
        if isinstance(body, Response):
            return body
        if self.publisher is None:
            return error_response(400, "this engine publishes no KV events")
        try:
            rate = float(body["blocks_per_s"])
            seconds = float(body.get("seconds", 10))
            batch = int(body.get("batch_blocks", 256))
        except (KeyError, TypeError, ValueError):
            return error_response(400, "need 'blocks_per_s' (and optional seconds, batch_blocks)")
        if rate <= 0 or seconds <= 0 or not 1 <= batch <= 4096 or self._flooding:
            return error_response(400, "bad flood parameters, or a flood is already running")
        self._flooding = True
        self._flood_task = asyncio.get_running_loop().create_task(self._flood(rate, seconds, batch))
        return JSONResponse({"started": True}, status_code=202)

    async def _flood(self, rate: float, seconds: float, batch: int) -> None:
        assert self.publisher is not None
        bs = self.config.block_size
        pairs = []
        for j in range(32):  # distinct runs of blocks; half of them resident at any time
            hashes = [(1 << 62) + j * batch + i for i in range(batch)]
            tokens = [(j * 7919 + i) % 50_000 for i in range(batch * bs)]
            store = self.engine.wire_out(
                encode_batch(
                    [
                        BlockStored(
                            block_hashes=hashes,
                            parent_block_hash=None,
                            token_ids=tokens,
                            block_size=bs,
                        )
                    ],
                    ts=time.time(),
                )
            )
            remove = self.engine.wire_out(
                encode_batch([BlockRemoved(block_hashes=hashes)], ts=time.time())
            )
            pairs.append((store, remove))
        loop = asyncio.get_running_loop()
        start = loop.time()
        sent = 0
        try:
            while loop.time() - start < seconds:
                due = int((loop.time() - start) * rate / batch)
                while sent < due:
                    j = sent % len(pairs)
                    self.publisher.publish(pairs[j][0])
                    if sent >= len(pairs) // 2:
                        self.publisher.publish(pairs[(sent - len(pairs) // 2) % len(pairs)][1])
                    sent += 1
                    self.flood_blocks += batch
                await asyncio.sleep(0.005)
        finally:
            self._flooding = False

    async def debug_fail(self, request: Request) -> Response:
        """`{"path": "/kv_event_sources", "times": N, "status": 503}`: the next N requests
        to `path` get `status` (a flaky engine, for discovery tests)."""
        body = await _json(request)
        if isinstance(body, Response):
            return body
        path, times, status = body.get("path"), body.get("times", 1), body.get("status", 503)
        if path != "/kv_event_sources" or not isinstance(times, int) or times < 0:
            return error_response(400, "path must be /kv_event_sources and times an int >= 0")
        if not isinstance(status, int) or not 400 <= status <= 599:
            return error_response(400, "status must be an HTTP error status (400-599)")
        self._failing[path] = (times, status)
        return JSONResponse({"path": path, "times": times, "status": status})

    def _injected_failure(self, path: str) -> Response | None:
        times, status = self._failing.get(path, (0, 0))
        if times <= 0:
            return None
        self._failing[path] = (times - 1, status)
        return error_response(status, f"injected failure ({times - 1} more)")

    async def debug_health(self, request: Request) -> Response:
        body = await _json(request)
        if isinstance(body, Response):
            return body
        self.healthy = bool(body.get("healthy", True))
        return JSONResponse({"healthy": self.healthy})

    async def tokenize(self, request: Request) -> Response:
        body = await _parse(request, TokenizeBody)
        if isinstance(body, Response):
            return body
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of 'prompt' or 'messages'")
        try:
            if body.messages is not None:
                text = self.tokenizer.apply_chat_template(body.messages, body.add_generation_prompt)
            else:
                text = body.prompt or ""
            tokens = self.tokenizer.encode(text)
        except (TypeError, ValueError) as exc:  # a lone surrogate: not encodable text
            return error_response(400, f"cannot tokenize the prompt: {exc}")
        return JSONResponse(
            {"count": len(tokens), "max_model_len": self.config.max_model_len, "tokens": tokens}
        )

    async def completions(self, request: Request) -> Response:
        body = await _parse(request, CompletionBody)
        if isinstance(body, Response):
            return body
        try:
            if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
                if len(body.prompt) != 1:
                    return error_response(400, "only one prompt per request is supported")
                prompt_ids = self.tokenizer.encode(body.prompt[0])
            elif isinstance(body.prompt, str):
                prompt_ids = self.tokenizer.encode(body.prompt)
            else:
                prompt_ids = list(body.prompt)
        except ValueError as exc:  # a lone surrogate: not encodable text
            return error_response(400, f"cannot tokenize the prompt: {exc}")
        return await self._serve(request, body, prompt_ids, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await _parse(request, ChatBody)
        if isinstance(body, Response):
            return body
        if has_media({"messages": body.messages}):
            return await self._chat_with_media(request, body)
        try:
            text = self.tokenizer.apply_chat_template(body.messages, True)
            prompt_ids = self.tokenizer.encode(text)
        except (TypeError, ValueError) as exc:  # a lone surrogate: not encodable text
            return error_response(400, f"cannot tokenize the prompt: {exc}")
        return await self._serve(request, body, prompt_ids, chat=True)

    async def _chat_with_media(self, request: Request, body: ChatBody) -> Response:
        """A chat prompt with images, expanded and identified as the gateway does
        (`quillcache.tokenization.multimodal`: one image token per 16x16 patch, vLLM's
        hash of the image for this engine's model): the engine caches and publishes its
        blocks with their multimodal extra keys, as vLLM does. Images come as data URLs
        (an engine fetching URLs is not modelled)."""
        try:
            mm = self.multimodal.prompt_now(self.tokenizer, body.model_dump(), self.config.model)
        except (MediaError, MultimodalUnavailable, TypeError) as exc:
            return error_response(400, f"cannot load the request's images: {exc}")
        return await self._serve(
            request, body, mm.tokens, chat=True, mm=mm.blocks(self.config.block_size)
        )

    async def _serve(
        self,
        request: Request,
        body: _Body,
        prompt: list[int],
        *,
        chat: bool,
        mm: MmBlocks | None = None,
    ) -> Response:
        lora, err = self._lora(body.model)
        if err is not None:
            return err
        if not prompt:
            return error_response(400, "the prompt is empty")
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        max_tokens = 16 if max_tokens is None else max_tokens
        if len(prompt) + max_tokens > self.config.max_model_len:
            return error_response(
                400,
                f"This model's maximum context length is {self.config.max_model_len} tokens; "
                f"the request has {len(prompt)} prompt tokens and asks for {max_tokens} more.",
            )
        model = body.model or self.config.model
        salt = body.cache_salt or ""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        admitted: list[Admission] = []
        engine = self._pick_rank(request)
        if isinstance(engine, JSONResponse):
            return engine
        try:
            engine.check(len(prompt), max_tokens)
        except EngineRequestError as exc:
            return error_response(400, str(exc))
        stream = engine.generate(
            prompt,
            max_tokens,
            self._token_maker(prompt),
            salt=salt,
            lora=lora,
            on_admitted=admitted.append,
            mm=mm,
        )
        usage = lambda n: {  # noqa: E731
            "prompt_tokens": len(prompt),
            "completion_tokens": n,
            "total_tokens": len(prompt) + n,
            "prompt_tokens_details": {
                "cached_tokens": admitted[0].cached_tokens if admitted else 0
            },
        }
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            gen = _sse(self, stream, rid, created, model, chat, include_usage, usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        ids = await _collect_or_abort(request, stream)
        if ids is None:  # the client left: the request is aborted, nobody to answer
            return Response(status_code=499)
        text = self.tokenizer.decode(ids)
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
            obj = "text_completion"
        return JSONResponse(
            {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage(len(ids)),
            }
        )

    def starlette(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models_list, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/debug/drop_events", self.debug_drop_events, methods=["POST"]),
            Route("/debug/health", self.debug_health, methods=["POST"]),
            Route("/debug/fail", self.debug_fail, methods=["POST"]),
            Route("/debug/flood", self.debug_flood, methods=["GET", "POST", "DELETE"]),
        ]
        if self.flavor == "sglang":  # where the KV events are: the server arguments
            routes.append(Route("/server_info", self.server_info, methods=["GET"]))
            routes.append(Route("/get_server_info", self.server_info, methods=["GET"]))
            routes.append(Route("/flush_cache", self.reset_prefix_cache, methods=["GET", "POST"]))
        else:
            routes.append(Route("/kv_event_sources", self.kv_event_sources, methods=["GET"]))
            routes.append(Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]))
        return Starlette(routes=routes)


async def _sse(
    app: EngineApp,
    stream: AsyncIterator[int],
    rid: str,
    created: int,
    model: str,
    chat: bool,
    include_usage: bool,
    usage: Callable[[int], dict[str, Any]],
) -> AsyncIterator[bytes]:
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(choice: dict[str, Any] | None, extra: dict[str, Any] | None = None) -> bytes:
        data: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model}
        data["choices"] = [] if choice is None else [choice]
        data.update(extra or {})
        return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"

    def piece(text: str, finish: str | None) -> dict[str, Any]:
        if chat:
            return {"index": 0, "delta": {"content": text}, "finish_reason": finish}
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    if chat:
        yield chunk(
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        )
    n = 0
    try:
        async for token in stream:
            n += 1
            yield chunk(piece(app.tokenizer.decode([token]), None))
        yield chunk(piece("", "length"))
        if include_usage:
            yield chunk(None, {"usage": usage(n)})
        yield b"data: [DONE]\n\n"
    finally:
        await stream.aclose()  # type: ignore[attr-defined]  # frees the engine slot at once


async def _collect_or_abort(request: Request, stream: AsyncIterator[int]) -> list[int] | None:
    """Every generated token, or None when the client disconnects first: then the
    generator is closed, which aborts the request in the engine (as vLLM's API server
    does for a non-streamed request, not only for a stream). One watcher task that
    cancels this one, rather than racing two tasks per request."""
    me = asyncio.current_task()
    assert me is not None
    client_left = False

    async def watch() -> None:
        nonlocal client_left
        while (await request.receive())["type"] != "http.disconnect":
            pass
        client_left = True
        me.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return [t async for t in stream]
    except asyncio.CancelledError:
        if not client_left:
            raise
        me.uncancel()
        return None
    finally:
        watcher.cancel()
        await stream.aclose()  # type: ignore[attr-defined]


async def _json(request: Request) -> dict[str, Any] | Response:
    raw = await request.body()
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_response(400, "request body must be a JSON object")
    return body


async def _parse(request: Request, model: type[BaseModel]) -> Any:
    body = await _json(request)
    if isinstance(body, Response):
        return body
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
        )
        return error_response(400, f"invalid request: {problems}")
