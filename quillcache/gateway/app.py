"""The gateway application: OpenAI proxy with cache-aware routing, admin and ingest.

Request path: parse -> tokens (local or engine /tokenize) -> namespace -> content keys
-> `ControlPlane.route` -> forward (retry once elsewhere on a failed connect) ->
stream back. Event path (other thread): ZMQ/HTTP -> bounded queue -> index.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import importlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import httpx
import msgpack
import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quillcache.connectors import EventIngestor
from quillcache.connectors.sink import ControlPlaneSink
from quillcache.controlplane import ControlPlane, UnknownWorkerError
from quillcache.errors import ConfigError, EventDecodeError, QuillCacheError
from quillcache.gateway import proxy
from quillcache.gateway.config import GatewayConfig, WorkerConfig
from quillcache.gateway.keys import content_keys, namespace
from quillcache.gateway.metrics import GatewayMetrics, counter, gauge
from quillcache.gateway.proxy import error_json
from quillcache.gateway.tokenization import RequestTokenizer, TokenizationError
from quillcache.gateway.workers import DiscoveryError, Worker, WorkerPool
from quillcache.index.native import NativeIndex
from quillcache.routing import Action, Router
from quillcache.routing import Request as RouteRequest

log = logging.getLogger(__name__)

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)
_UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)


def resolve_router(spec: str, options: dict[str, Any]) -> Router | str:
    """A registered router name, or "pkg.module:Class" for a user's router class."""
    if ":" not in spec:
        return spec
    module_name, _, attr = spec.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"router {spec!r}: cannot import it: {exc}") from exc
    try:
        router = cls(**options)
    except TypeError as exc:
        raise ConfigError(f"router {spec!r}: bad router_options: {exc}") from exc
    if not callable(getattr(router, "route", None)):
        raise ConfigError(f"router {spec!r} has no route(request, view) method")
    return router  # type: ignore[no-any-return]


class Gateway:
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.metrics = GatewayMetrics()
        self.cp: ControlPlane
        self.ingestor: EventIngestor
        self.pool: WorkerPool
        self.client: httpx.AsyncClient  # control calls: discovery, health, metrics, tokenize
        self.upstream: aiohttp.ClientSession  # the proxied requests
        self.tokenizer: RequestTokenizer
        self.router_name = config.router
        self._tasks: list[asyncio.Task[None]] = []
        self.started = False
        self.startup_error: QuillCacheError | None = None
        self.index_guard: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        # tokenize + hash + route time of recent requests, for /admin/index
        self.route_samples: collections.deque[float] = collections.deque(maxlen=20_000)
        # handler entry -> upstream request issued (parse, auth, tokenize, hash, route)
        self.pre_upstream_samples: collections.deque[float] = collections.deque(maxlen=20_000)
        # upstream chunk received -> written to the client, per streamed chunk
        self.relay_samples: collections.deque[float] = collections.deque(maxlen=50_000)

    # -- lifecycle -----------------------------------------------------------------------

    async def startup(self) -> None:
        cfg = self.config
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=cfg.max_connections,
                max_keepalive_connections=cfg.max_connections,
            ),
        )
        self.upstream = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=cfg.max_connections, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(
                total=cfg.request_timeout_s, sock_connect=cfg.connect_timeout_s
            ),
            auto_decompress=False,
        )
        described = await asyncio.gather(
            *(WorkerPool.describe(self.client, w) for w in cfg.workers)
        )
        sizes = {w.block_size for w in described if w.block_size is not None}
        if cfg.block_size is not None:
            sizes.add(cfg.block_size)
        if len(sizes) > 1:
            raise ConfigError(f"engines disagree on the block size: {sorted(sizes)}")
        block_size = cfg.block_size or (sizes.pop() if sizes else 16)
        router = resolve_router(cfg.router, cfg.router_options)
        self.router_name = router if isinstance(router, str) else type(router).__name__
        self.cp = ControlPlane(
            index=cfg.index,
            router=router,
            block_size=block_size,
            track_load=True,
            speculative=True,
            speculative_ttl_s=cfg.speculative_ttl_s,
            router_options=cfg.router_options if isinstance(router, str) else None,
            index_options=cfg.index_options,
        )
        # The native index serialises readers and writers itself (an RwLock, GIL released);
        # any other backend is guarded by one lock shared by ingest and routing.
        if not isinstance(self.cp.index, NativeIndex):
            self.index_guard = threading.Lock()
        self.sink = ControlPlaneSink(self.cp, guard=self.index_guard)
        self.ingestor = EventIngestor(
            self.sink,
            queue_size=cfg.event_queue_size,
            queue_bytes=cfg.event_queue_bytes,
            replay_timeout_s=cfg.replay_timeout_s,
            stale_rebuild_s=cfg.stale_rebuild_s,
        )
        self.pool = WorkerPool(self.cp, self.ingestor, self.client, tokenizer_id=cfg.tokenizer_id)
        self.pool.guard = self.index_guard
        self.pool.failures_to_down = cfg.health_failures_to_down
        self.pool.resume_seqs = self.sink.last_seqs()
        if self.pool.resume_seqs:
            log.info("persistent index: resuming sources at %s", self.pool.resume_seqs)
        for w in described:
            self.pool.attach(w)
        self.tokenizer = RequestTokenizer(cfg.tokenizer, self.upstream)
        self.metrics.add_collector(self._collect)
        self._tasks = [
            asyncio.create_task(self._every(cfg.health_interval_s, self.pool.check_health)),
            asyncio.create_task(self._every(cfg.scrape_interval_s, self.pool.scrape)),
        ]
        if cfg.parity_check:
            for w in list(self.pool.workers.values()):
                self._tasks.append(asyncio.create_task(self.parity_check(w)))
        self.started = True

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if hasattr(self, "ingestor"):
            self.ingestor.close()
        if hasattr(self, "client"):
            await self.client.aclose()
        if hasattr(self, "upstream"):
            await self.upstream.close()
        if hasattr(self, "cp"):
            self.cp.close()

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        try:
            await self.startup()
        except QuillCacheError as exc:
            self.startup_error = exc  # the CLI reports it in one line
            await self.shutdown()
            raise
        try:
            yield
        finally:
            await self.shutdown()

    async def _every(self, interval_s: float, job: Any) -> None:
        while True:
            try:
                await job()
            except Exception:
                log.exception("gateway background job %s failed", getattr(job, "__name__", job))
            await asyncio.sleep(interval_s)

    # -- request identity ----------------------------------------------------------------

    def _namespace_of(self, model: str | None, tenant: str) -> tuple[int, str]:
        models = self.pool.models()
        lora = models.get(model or "", "")
        base = ""
        for w in self.pool.workers.values():
            if not model or model in w.models:
                base = w.base_model
                break
        ns = namespace(base, self.config.tokenizer_id, lora, tenant, self.cp.block_size)
        return ns, lora

    async def _route_request(
        self, body: dict[str, Any], chat: bool, headers: Any
    ) -> tuple[RouteRequest, int]:
        tenant = str(body.get("cache_salt") or "")
        any_worker = self.pool.any_routable()
        tokens = await self.tokenizer.tokens(body, chat, any_worker.url if any_worker else None)
        ns, _ = self._namespace_of(body.get("model"), tenant)
        keys = content_keys(tokens, self.cp.block_size, ns)
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        request = RouteRequest(
            request_id=uuid.uuid4().hex,
            content_keys=keys,
            prompt_tokens=len(tokens),
            namespace=ns,
            session_id=headers.get(self.config.session_header),
            expected_output_tokens=int(max_tokens) if isinstance(max_tokens, int) else 16,
            arrival_s=time.monotonic(),
        )
        return request, len(tokens)

    # -- auth ----------------------------------------------------------------------------

    def _check_api_key(self, request: Request) -> Response | None:
        if not self.config.api_keys:
            return None
        given = _bearer(request)
        if given and any(hmac.compare_digest(given, k) for k in self.config.api_keys):
            return None
        return error_json(
            401, "missing or invalid API key (Authorization: Bearer <key>)", "AuthenticationError"
        )

    def _check_admin(self, request: Request) -> Response | None:
        token = self.config.admin_token
        if token is None:
            return error_json(
                403,
                "the admin API is disabled: set admin_token in the config",
                "PermissionDeniedError",
            )
        given = _bearer(request)
        if given and hmac.compare_digest(given, token):
            return None
        return error_json(
            401,
            "missing or invalid admin token (Authorization: Bearer <token>)",
            "AuthenticationError",
        )

    # -- the proxy -----------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._proxy(request, "/v1/chat/completions", chat=True)

    async def _proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        started = time.perf_counter()
        denied = self._check_api_key(request)
        if denied is not None:
            return self._count(path, denied)
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return self._count(path, raw)
        body = _parse_body(raw)
        if isinstance(body, Response):
            return self._count(path, body)
        problem = _validate(body, chat)
        if problem:
            return self._count(path, error_json(400, problem))
        model = body.get("model")
        models = self.pool.models()
        if model is not None and models and model not in models:
            known = ", ".join(sorted(models))
            return self._count(
                path,
                error_json(
                    404, f"The model `{model}` does not exist; served: {known}", "NotFoundError"
                ),
            )
        tenant_header = request.headers.get(self.config.tenant_header)
        if tenant_header and not body.get("cache_salt"):
            body["cache_salt"] = tenant_header  # the engine must isolate it too
            raw = json.dumps(body).encode()
        try:
            routing_started = time.perf_counter()
            route_request, prompt_tokens = await self._route_request(body, chat, request.headers)
        except TokenizationError as exc:
            return self._count(path, error_json(400, f"cannot tokenize the request: {exc}"))
        except (ValueError, TypeError, QuillCacheError) as exc:  # e.g. HashingError
            return self._count(path, error_json(400, f"invalid prompt: {exc}"))
        excluded: set[int] = set()
        for attempt in range(2):
            with self.index_guard:
                decision = self.cp.route(route_request, now_s=time.monotonic())
            # tokenize (local: no await; engine: one round trip) + hash + route
            routed_s = time.perf_counter() - routing_started
            self.metrics.route_time.observe(routed_s)
            self.route_samples.append(routed_s)
            if decision.rejected:
                self.cp.finish(route_request.request_id)
                reason = decision.reason or "rejected"
                self.metrics.decisions.labels(self.router_name, reason[:60], "none").inc()
                status = 503 if "no routable worker" in reason else 429
                kind = "ServiceUnavailableError" if status == 503 else "RateLimitError"
                return self._count(path, error_json(status, f"request not routed: {reason}", kind))
            worker = self.pool.get(decision.worker)  # type: ignore[arg-type]
            self.metrics.decisions.labels(
                self.router_name, decision.reason or "chosen", str(worker.id)
            ).inc()
            cached_blocks = decision.blocks_by_action()[Action.REUSE]
            self.metrics.predicted_hit_tokens.inc(
                min(cached_blocks * self.cp.block_size, prompt_tokens)
            )
            self.metrics.prompt_tokens.inc(prompt_tokens)
            self.pre_upstream_samples.append(time.perf_counter() - started)
            try:
                resp = await self.upstream.post(
                    worker.url + path,
                    data=raw,
                    headers=self._upstream_headers(request, worker, route_request),
                )
            except _CONNECT_ERRORS as exc:
                self.cp.finish(route_request.request_id)
                self.pool.mark_down(worker.id, f"connect failed: {type(exc).__name__}")
                excluded.add(worker.id)
                if attempt == 0:
                    self.metrics.retries.labels(str(worker.id)).inc()
                    continue
                return self._count(
                    path,
                    error_json(
                        502, f"engine {worker.url} unreachable: {exc}", "APIConnectionError"
                    ),
                )
            except _UPSTREAM_ERRORS as exc:
                self.cp.finish(route_request.request_id)
                return self._count(
                    path,
                    error_json(
                        502, f"engine {worker.url} failed: {type(exc).__name__}", "APIError"
                    ),
                )
            return await self._respond(request, path, resp, worker, route_request, started)
        raise AssertionError("unreachable")

    async def _respond(
        self,
        request: Request,
        path: str,
        resp: aiohttp.ClientResponse,
        worker: Worker,
        route_request: RouteRequest,
        started: float,
    ) -> Response:
        rid = route_request.request_id
        extra = {"x-quillcache-worker": str(worker.id)}
        streaming = "text/event-stream" in resp.headers.get("content-type", "")
        if streaming and resp.status == 200:

            def first_byte() -> None:
                self.metrics.ttft.labels(path).observe(time.perf_counter() - started)
                self.cp.prefill_done(rid)

            def end(failure: BaseException | None) -> None:
                self.cp.finish(rid)
                if isinstance(failure, _UPSTREAM_ERRORS):
                    self.pool.mark_down(worker.id, f"broke mid-stream: {type(failure).__name__}")
                self.metrics.latency.labels(path).observe(time.perf_counter() - started)

            self.metrics.requests.labels(path, "200").inc()
            stream = proxy.relay_stream(
                resp,
                on_first_byte=first_byte,
                on_end=end,
                on_cached_tokens=self.metrics.actual_hit_tokens.inc,
                relay_samples=self.relay_samples,
            )
            return proxy.streaming_response(resp, stream, extra)
        try:
            content = await proxy.read_or_cancel(request, resp)
        except _UPSTREAM_ERRORS as exc:
            self.cp.finish(rid)
            self.pool.mark_down(worker.id, f"broke mid-response: {type(exc).__name__}")
            return self._count(
                path, error_json(502, f"engine failed mid-response: {exc}", "APIError")
            )
        self.cp.finish(rid)
        if content is None:  # the client left: upstream closed, nothing to send
            self.metrics.requests.labels(path, "499").inc()
            return Response(status_code=499)
        self.metrics.ttft.labels(path).observe(time.perf_counter() - started)
        self.metrics.latency.labels(path).observe(time.perf_counter() - started)
        if resp.status == 200:
            cached = proxy.usage_cached_tokens(content)
            if cached is not None:
                self.metrics.actual_hit_tokens.inc(cached)
        self.metrics.requests.labels(path, str(resp.status)).inc()
        return proxy.passthrough_response(resp, content, extra)

    def _upstream_headers(
        self, request: Request, worker: Worker, route_request: RouteRequest
    ) -> dict[str, str]:
        """Forwarded headers; for a data-parallel engine, also vLLM's `X-data-parallel-rank`
        naming the rank that holds the longest prefix (its internal balancer would not
        know which one does)."""
        headers = _forward_headers(request)
        if len(worker.sources) > 1 and len(route_request.content_keys):
            with self.index_guard:
                matches = self.cp.index.match(route_request.content_keys)
            best = max(
                (m for m in matches if m.worker == worker.id and m.blocks > 0),
                key=lambda m: m.blocks,
                default=None,
            )
            if best is not None:
                headers["x-data-parallel-rank"] = str(best.dp_rank)
        return headers

    async def _read_body(self, request: Request) -> bytes | Response:
        """The request body, or a 413 once it exceeds `max_body_bytes` (read in chunks, so
        a lying or missing Content-Length cannot make us buffer more)."""
        limit = self.config.max_body_bytes
        declared = request.headers.get("content-length", "")
        too_big = error_json(413, f"request body larger than {limit} bytes", "PayloadTooLarge")
        if declared.isdigit() and int(declared) > limit:
            return too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return too_big
            chunks.append(chunk)
        return b"".join(chunks)

    def _count(self, path: str, response: Response) -> Response:
        self.metrics.requests.labels(path, str(response.status_code)).inc()
        return response

    # -- plain endpoints -----------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        denied = self._check_api_key(request)
        if denied is not None:
            return denied
        now = int(time.time())
        data = []
        for name, lora in sorted(self.pool.models().items()):
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": now,
                    "owned_by": "quillcache",
                    "parent": None if not lora else self._namespace_base(name),
                }
            )
        return JSONResponse({"object": "list", "data": data})

    def _namespace_base(self, model: str) -> str:
        for w in self.pool.workers.values():
            if model in w.models:
                return w.base_model
        return ""

    async def health(self, request: Request) -> Response:
        routable = [w.id for w in self.pool.workers.values() if w.routable]
        status = 200 if routable else 503
        return JSONResponse(
            {"status": "ok" if routable else "no routable worker", "routable_workers": routable},
            status_code=status,
        )

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _collect(self) -> Iterator[Any]:
        s = self.ingestor.stats()
        yield counter(
            "quillcache_kv_event_batches_received", "KV event batches received.", s.received
        )
        yield counter(
            "quillcache_kv_event_batches_applied",
            "Batches applied to the index.",
            s.applied_batches,
        )
        yield counter(
            "quillcache_kv_event_batches_dropped",
            "Batches dropped by the full ingest queue (replayed later).",
            s.dropped,
        )
        yield counter(
            "quillcache_kv_blocks_stored", "Blocks stored by applied events.", s.blocks_stored
        )
        yield counter(
            "quillcache_kv_blocks_removed", "Blocks removed by applied events.", s.blocks_removed
        )
        yield counter("quillcache_kv_event_gaps", "Sequence gaps seen.", s.gaps)
        yield counter("quillcache_kv_event_replays", "Replays requested.", s.replays)
        yield counter(
            "quillcache_kv_event_replay_failures",
            "Replays that did not cover their gap.",
            s.replay_failures,
        )
        yield counter(
            "quillcache_kv_source_stale_marks", "Times a source was marked stale.", s.stale_marks
        )
        yield counter(
            "quillcache_kv_engine_restarts", "Engine restarts seen (seq backwards).", s.restarts
        )
        yield counter("quillcache_kv_event_decode_errors", "Undecodable batches.", s.decode_errors)
        yield gauge(
            "quillcache_kv_stale_sources",
            "Sources whose residency is unknown.",
            {(): s.stale_sources},
            [],
        )
        yield gauge(
            "quillcache_kv_ingest_queue_depth",
            "Batches waiting to be applied.",
            {(): s.queue_depth},
            [],
        )
        with self.index_guard:
            stats = self.cp.index.stats()
        yield gauge(
            "quillcache_index_blocks", "Distinct blocks in the index.", {(): stats.blocks}, []
        )
        yield gauge(
            "quillcache_index_resident_pairs",
            "(block, source, medium) entries.",
            {(): stats.resident_pairs},
            [],
        )
        workers = list(self.pool.workers.values())
        per = {(str(w.id),): float(self.cp.worker(w.id).in_flight) for w in workers}
        yield gauge(
            "quillcache_worker_in_flight", "Requests in flight per worker.", per, ["worker"]
        )
        yield gauge(
            "quillcache_worker_engine_running",
            "Engine-reported running requests.",
            {(str(w.id),): w.load.running for w in workers},
            ["worker"],
        )
        yield gauge(
            "quillcache_worker_engine_waiting",
            "Engine-reported waiting requests.",
            {(str(w.id),): w.load.waiting for w in workers},
            ["worker"],
        )
        yield gauge(
            "quillcache_worker_kv_usage",
            "Engine-reported KV-cache usage (0..1).",
            {(str(w.id),): w.load.kv_usage for w in workers},
            ["worker"],
        )
        yield gauge(
            "quillcache_worker_healthy",
            "1 when the worker passes health checks.",
            {(str(w.id),): float(w.healthy) for w in workers},
            ["worker"],
        )
        yield gauge(
            "quillcache_worker_parity_ok",
            "1 when the startup parity check passed.",
            {(str(w.id),): float(w.parity == "ok") for w in workers},
            ["worker"],
        )

    # -- parity self-check ---------------------------------------------------------------

    async def parity_check(self, w: Worker, timeout_s: float = 5.0) -> str:
        """Send probe prompts to one engine and check that the blocks its events report
        are exactly the keys we predict; warn loudly otherwise (tokenizer, chat template,
        block size or namespace mismatch would make every routing decision blind). With a
        local tokenizer a chat probe checks the chat template too."""
        if not w.sources:
            w.parity = "skipped: no KV event source"
            return w.parity
        probe = f"quillcache parity probe {uuid.uuid4().hex} " * 8
        probes: list[tuple[str, dict[str, Any], bool]] = [
            ("completion", {"model": w.base_model, "prompt": probe, "max_tokens": 1}, False)
        ]
        if self.tokenizer.local is not None:
            messages = [{"role": "user", "content": probe + " chat"}]
            chat = {"model": w.base_model, "messages": messages, "max_tokens": 1}
            probes.append(("chat template", chat, True))
        problems = []
        for name, body, is_chat in probes:
            try:
                problem = await self._probe(w, body, is_chat, timeout_s)
            except (httpx.HTTPError, QuillCacheError) as exc:
                w.parity = f"skipped: probe failed: {exc}"
                log.warning("parity check of worker %d skipped: %s", w.id, exc)
                return w.parity
            if problem:
                problems.append(f"{name}: {problem}")
        if not problems:
            w.parity = "ok"
            log.info("parity check of worker %d passed", w.id)
            return w.parity
        w.parity = "mismatch: " + "; ".join(problems)
        log.error(
            "PARITY CHECK FAILED for worker %d (%s): %s. Routing will not see this engine's "
            "cache: check the tokenizer, chat template, block size and model name.",
            w.id,
            w.url,
            w.parity,
        )
        return w.parity

    async def _probe(
        self, w: Worker, body: dict[str, Any], chat: bool, timeout_s: float
    ) -> str | None:
        """One probe request; None when the engine's events cover every predicted block."""
        tokens = await self.tokenizer.tokens(body, chat, w.url)
        ns, _ = self._namespace_of(w.base_model, "")
        keys = content_keys(tokens, self.cp.block_size, ns)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        resp = await self.client.post(f"{w.url}{path}", json=body)
        resp.raise_for_status()
        deadline = time.monotonic() + timeout_s
        held = 0
        while time.monotonic() < deadline:
            with self.index_guard:
                matches = self.cp.index.match(keys)
            held = max((m.blocks for m in matches if m.worker == w.id), default=0)
            if held >= len(keys):
                return None
            await asyncio.sleep(0.05)
        return f"engine events cover {held} of {len(keys)} predicted blocks"

    # -- admin ---------------------------------------------------------------------------

    async def admin_workers(self, request: Request) -> Response:
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        if request.method == "GET":
            return JSONResponse({"workers": [w.as_dict() for w in self.pool.workers.values()]})
        body = _parse_body(await request.body())
        if isinstance(body, Response):
            return body
        try:
            cfg = WorkerConfig.model_validate(body)
        except ValueError as exc:
            return error_json(400, f"invalid worker: {exc}")
        try:
            w = await self.pool.add(cfg)
        except DiscoveryError as exc:
            return error_json(400, str(exc))
        if self.config.parity_check:
            self._tasks.append(asyncio.create_task(self.parity_check(w)))
        return JSONResponse(w.as_dict(), status_code=201)

    async def admin_worker(self, request: Request) -> Response:
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        try:
            worker_id = int(request.path_params["worker_id"])
            if request.method == "DELETE":
                w = self.pool.remove(worker_id)
                return JSONResponse({"removed": w.id})
            if request.method == "GET":
                return JSONResponse(self.pool.get(worker_id).as_dict())
        except (ValueError, UnknownWorkerError) as exc:
            return error_json(404, str(exc), "NotFoundError")
        return error_json(405, "use GET or DELETE")

    async def admin_drain(self, request: Request) -> Response:
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        body = _parse_body(await request.body() or b"{}")
        if isinstance(body, Response):
            return body
        try:
            worker_id = int(request.path_params["worker_id"])
            self.pool.set_draining(worker_id, bool(body.get("draining", True)))
            return JSONResponse(self.pool.get(worker_id).as_dict())
        except (ValueError, UnknownWorkerError) as exc:
            return error_json(404, str(exc), "NotFoundError")

    async def _keys_of(self, body: dict[str, Any]) -> np.ndarray | Response:
        chat = "messages" in body
        problem = _validate(body, chat)
        if problem:
            return error_json(400, problem)
        try:
            request, _ = await self._route_request(body, chat, {})
        except (TokenizationError, ValueError, TypeError) as exc:
            return error_json(400, f"cannot tokenize: {exc}")
        return request.content_keys

    async def admin_lookup(self, request: Request) -> Response:
        """Which worker holds how much of this prompt (body: a completion or chat body)."""
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        body = _parse_body(await request.body())
        if isinstance(body, Response):
            return body
        keys = await self._keys_of(body)
        if isinstance(keys, Response):
            return keys
        with self.index_guard:
            matches = self.cp.index.match(keys)
        bs = self.cp.block_size
        return JSONResponse(
            {
                "blocks": len(keys),
                "block_size": bs,
                "matches": [
                    {
                        "worker": m.worker,
                        "dp_rank": m.dp_rank,
                        "medium": m.medium,
                        "blocks": m.blocks,
                        "tokens": m.blocks * bs,
                    }
                    for m in sorted(matches, key=lambda m: -m.blocks)
                ],
            }
        )

    async def admin_index(self, request: Request) -> Response:
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        with self.index_guard:
            stats = self.cp.index.stats()
        sources = [s.as_dict() for s in self.ingestor.sources.values()]
        response = JSONResponse(
            {
                "index": self.config.index,
                "blocks": stats.blocks,
                "resident_pairs": stats.resident_pairs,
                "sources": stats.sources,
                "memory_bytes": stats.memory_bytes,
                "extra": stats.extra,
                "event_sources": sources,
                "ingest": vars(self.ingestor.stats()),
                "route_latency_us": _percentiles_us(self.route_samples),
                "pre_upstream_us": _percentiles_us(self.pre_upstream_samples),
                "relay_chunk_us": _percentiles_us(self.relay_samples),
            }
        )
        if request.query_params.get("reset_latency"):
            self.route_samples.clear()
            self.pre_upstream_samples.clear()
            self.relay_samples.clear()
        return response

    async def admin_pins(self, request: Request) -> Response:
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        body = _parse_body(await request.body())
        if isinstance(body, Response):
            return body
        keys = await self._keys_of(body)
        if isinstance(keys, Response):
            return keys
        if request.method == "DELETE":
            with self.index_guard:
                self.cp.index.unpin(keys)
        else:
            with self.index_guard:
                self.cp.index.pin(keys)
        return JSONResponse({"pinned" if request.method == "POST" else "unpinned": len(keys)})

    # -- HTTP ingest ---------------------------------------------------------------------

    async def ingest(self, request: Request) -> Response:
        """KV events over HTTP. msgpack body = one raw batch (worker, dp_rank, seq from the
        query string); JSON body = {"worker", "dp_rank", "seq"?, "batches": [batch...]}
        with each batch as vLLM's structure in JSON (for humans and bridges)."""
        denied = self._check_admin(request)
        if denied is not None:
            return denied
        ctype = request.headers.get("content-type", "")
        raw = await self._read_body(request)
        if isinstance(raw, Response):
            return raw
        q = request.query_params
        try:
            if "msgpack" in ctype:
                worker = int(q["worker"])
                dp_rank = int(q.get("dp_rank", 0))
                seq = int(q["seq"]) if "seq" in q else None
                payloads = [raw]
            else:
                body = _parse_body(raw)
                if isinstance(body, Response):
                    return body
                worker = int(body["worker"])
                dp_rank = int(body.get("dp_rank", 0))
                seq = int(body["seq"]) if body.get("seq") is not None else None
                batches = body["batches"]
                if not isinstance(batches, list):
                    raise TypeError("'batches' must be a list")
                payloads = [msgpack.packb(b, use_bin_type=True) for b in batches]
        except (KeyError, ValueError, TypeError) as exc:
            return error_json(
                400,
                f"invalid ingest request: {exc!s} (need worker, and "
                "batches for JSON or ?worker= for msgpack)",
            )
        if worker not in self.pool.workers:
            return error_json(
                404, f"unknown worker {worker}; known: {sorted(self.pool.workers)}", "NotFoundError"
            )
        for i, payload in enumerate(payloads):
            error = _decode_error(payload)
            if error is not None:
                return error_json(400, f"batch {i} is not a valid KV event batch: {error}")
        accepted = self.ingestor.submit(worker, payloads, dp_rank, seq)
        if accepted < len(payloads):
            return error_json(
                503,
                f"ingest queue full: {accepted} of {len(payloads)} accepted",
                "ServiceUnavailableError",
            )
        return JSONResponse({"accepted": accepted}, status_code=202)

    # -- assembly ------------------------------------------------------------------------

    def starlette(self, *, with_lifespan: bool = True) -> Starlette:
        """The ASGI app; without lifespan the caller runs `startup`/`shutdown` itself."""
        routes = [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/admin/workers", self.admin_workers, methods=["GET", "POST"]),
            Route("/admin/workers/{worker_id}", self.admin_worker, methods=["GET", "DELETE"]),
            Route("/admin/workers/{worker_id}/drain", self.admin_drain, methods=["POST"]),
            Route("/admin/lookup", self.admin_lookup, methods=["POST"]),
            Route("/admin/index", self.admin_index, methods=["GET"]),
            Route("/admin/pins", self.admin_pins, methods=["POST", "DELETE"]),
            Route("/ingest/kv_events", self.ingest, methods=["POST"]),
        ]
        app = Starlette(routes=routes, lifespan=self.lifespan if with_lifespan else None)
        app.add_exception_handler(404, _not_found)  # type: ignore[arg-type]
        app.add_exception_handler(405, _not_allowed)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, _internal)
        hot = {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat_completions,
        }
        return _HotPath(app, hot)  # type: ignore[return-value]


class _HotPath:
    """Serve the two proxy endpoints straight from ASGI, everything else via Starlette.

    Starlette's middleware stack and router cost ~15% of the gateway's CPU per proxied
    request (py-spy); the hot endpoints need none of it. Errors still become a JSON 500.
    """

    def __init__(self, app: Starlette, hot: dict[str, Any]) -> None:
        self.app = app
        self.hot = hot
        self.router = app.router

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.hot.get(scope["path"])
            if handler is not None:
                request = Request(scope, receive)
                try:
                    response = await handler(request)
                except Exception as exc:
                    response = await _internal(request, exc)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _percentiles_us(samples: collections.deque[float]) -> dict[str, float]:
    if not samples:
        return {}
    values = np.fromiter(samples, dtype=np.float64) * 1e6
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "n": float(len(values))}


def _bearer(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    return auth[7:].strip() if auth.lower().startswith("bearer ") else None


def _forward_headers(request: Request) -> dict[str, str]:
    return {k: v for k in proxy.FORWARDED_HEADERS if (v := request.headers.get(k))}


def _parse_body(raw: bytes) -> dict[str, Any] | Response:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return error_json(400, f"request body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error_json(400, "request body must be a JSON object")
    return body


def _validate(body: dict[str, Any], chat: bool) -> str | None:
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return "'messages' must be a non-empty list of {role, content} objects"
        if not all(isinstance(m, dict) for m in messages):
            return "every message must be an object with 'role' and 'content'"
    else:
        prompt = body.get("prompt")
        if not isinstance(prompt, (str, list)) or (isinstance(prompt, list) and not prompt):
            return "'prompt' must be a string, a list with one string, or a list of token ids"
    if "model" in body and not isinstance(body["model"], str):
        return "'model' must be a string"
    if (
        "cache_salt" in body
        and body["cache_salt"] is not None
        and not isinstance(body["cache_salt"], str)
    ):
        return "'cache_salt' must be a string"
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            return f"'{field}' must be a non-negative integer"
    if "stream" in body and not isinstance(body["stream"], bool):
        return "'stream' must be true or false"
    return None


def _decode_error(payload: bytes) -> str | None:
    from quillcache import _native

    decode = getattr(_native, "decode_batch", None)
    if decode is None:
        from quillcache.events.pyref import decode_batch as decode
    try:
        decode(payload)
    except EventDecodeError as exc:
        return str(exc)
    except Exception as exc:  # any other failure of a decoder is still bad input
        return f"{type(exc).__name__}: {exc}"
    return None


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_json(
        404, f"no such endpoint: {request.method} {request.url.path}", "NotFoundError"
    )


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_json(
        405, f"method {request.method} not allowed on {request.url.path}", "MethodNotAllowed"
    )


async def _internal(request: Request, exc: Exception) -> Response:
    log.exception("gateway: unhandled error on %s", request.url.path, exc_info=exc)
    return error_json(500, f"internal gateway error: {type(exc).__name__}", "InternalServerError")
