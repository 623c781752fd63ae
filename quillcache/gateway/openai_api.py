"""The OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

A proxied request: check the API key, read and check the body, derive its content keys
(`Gateway.identify`), route, forward (once more elsewhere when the connect fails), and
relay the answer (`proxy`). Every answer, error or not, is counted by endpoint and status.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

import aiohttp
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache.errors import QuillCacheError
from quillcache.gateway import proxy
from quillcache.gateway.httpio import (
    ApiError,
    check_bearer,
    parse_object,
    read_body,
    validate_completion,
)
from quillcache.gateway.tokenization import EngineUnreachable, TokenizationError
from quillcache.routing import Action
from quillcache.routing import Request as RouteRequest

if TYPE_CHECKING:
    from quillcache.gateway.app import Gateway
    from quillcache.gateway.workers import Worker

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


class OpenAIEndpoints:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, COMPLETIONS, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(request, CHAT_COMPLETIONS, chat=True)

    async def models(self, request: Request) -> Response:
        self._check_api_key(request)
        gw, now = self.gw, int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "quillcache",
                "parent": gw.base_model_of(name) if lora else None,
            }
            for name, lora in sorted(gw.pool.models().items())
        ]
        return JSONResponse({"object": "list", "data": data})

    # -- one proxied request -------------------------------------------------------------

    async def _counted(self, request: Request, path: str, *, chat: bool) -> Response:
        try:
            response = await self._proxy(request, path, chat=chat)
        except ApiError as exc:
            response = exc.response()
        self.gw.metrics.request_done(path, response.status_code)
        return response

    def _check_api_key(self, request: Request) -> None:
        if self.gw.config.api_keys:
            check_bearer(request, self.gw.config.api_keys, "API key")

    async def _proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        gw = self.gw
        started = time.perf_counter()
        self._check_api_key(request)
        raw = await read_body(request, gw.config.max_body_bytes)
        body = parse_object(raw)
        validate_completion(body, chat)
        model = body.get("model")
        models = gw.pool.models()
        if model is not None and models and model not in models:
            known = ", ".join(sorted(models))
            raise ApiError(
                404, f"The model `{model}` does not exist; served: {known}", "NotFoundError"
            )
        tenant_header = request.headers.get(gw.config.tenant_header)
        if tenant_header and not body.get("cache_salt"):
            body["cache_salt"] = tenant_header  # the engine must isolate it too
            raw = json.dumps(body).encode()
        routing_started = time.perf_counter()  # tokenize + hash + route, for /admin/index
        try:
            route_request, prompt_tokens = await gw.identify(body, chat, request.headers)
        except EngineUnreachable as exc:  # dead engines, not a bad request
            raise ApiError(
                503, f"cannot tokenize the request: {exc}", "ServiceUnavailableError"
            ) from None
        except TokenizationError as exc:
            raise ApiError(400, f"cannot tokenize the request: {exc}") from None
        except (ValueError, TypeError, QuillCacheError) as exc:  # e.g. HashingError
            raise ApiError(400, f"invalid prompt: {exc}") from None
        for attempt in range(2):
            worker = self._route(route_request, prompt_tokens, routing_started)
            gw.pre_upstream_samples.append(time.perf_counter() - started)
            try:
                resp = await gw.upstream.post(
                    worker.url + path,
                    data=raw,
                    headers=self._upstream_headers(request, worker, route_request),
                )
            except _CONNECT_ERRORS as exc:
                gw.cp.finish(route_request.request_id)
                gw.pool.mark_down(worker.id, f"connect failed: {type(exc).__name__}")
                if attempt == 0:  # the down worker is not routable any more: retry elsewhere
                    gw.metrics.retries.labels(str(worker.id)).inc()
                    continue
                raise ApiError(
                    502, f"engine {worker.url} unreachable: {exc}", "APIConnectionError"
                ) from None
            except UPSTREAM_ERRORS as exc:
                gw.cp.finish(route_request.request_id)
                raise ApiError(
                    502, f"engine {worker.url} failed: {type(exc).__name__}", "APIError"
                ) from None
            return await self._respond(request, path, resp, worker, route_request, started)
        raise AssertionError("unreachable")

    def _route(self, route_request: RouteRequest, prompt_tokens: int, since: float) -> Worker:
        """Route one request (raises the 503/429 of a rejection) and count the decision."""
        gw = self.gw
        with gw.index_guard:
            decision = gw.cp.route(route_request, now_s=time.monotonic())
        routed_s = time.perf_counter() - since
        gw.metrics.route_time.observe(routed_s)
        gw.route_samples.append(routed_s)
        if decision.rejected:
            gw.cp.finish(route_request.request_id)
            reason = decision.reason or "rejected"
            gw.metrics.decision(gw.router_name, reason[:60], "none")
            if "no routable worker" in reason:
                raise ApiError(503, f"request not routed: {reason}", "ServiceUnavailableError")
            raise ApiError(429, f"request not routed: {reason}", "RateLimitError")
        worker = gw.pool.get(decision.worker)  # type: ignore[arg-type]
        gw.metrics.decision(gw.router_name, decision.reason or "chosen", str(worker.id))
        # (blocks_by_action builds a dict over the whole Action enum: 2% of the CPU here)
        cached_blocks = sum(step.blocks for step in decision.plan if step.action == Action.REUSE)
        gw.metrics.predicted_hit_tokens.inc(min(cached_blocks * gw.cp.block_size, prompt_tokens))
        gw.metrics.prompt_tokens.inc(prompt_tokens)
        return worker

    async def _respond(
        self,
        request: Request,
        path: str,
        resp: aiohttp.ClientResponse,
        worker: Worker,
        route_request: RouteRequest,
        started: float,
    ) -> Response:
        gw, rid = self.gw, route_request.request_id
        extra = {"x-quillcache-worker": str(worker.id)}
        streaming = "text/event-stream" in resp.headers.get("content-type", "")
        if streaming and resp.status == 200:

            def first_byte() -> None:
                gw.metrics.first_byte(path, time.perf_counter() - started)
                gw.cp.prefill_done(rid)

            def end(failure: BaseException | None) -> None:
                gw.cp.finish(rid)
                if isinstance(failure, UPSTREAM_ERRORS):
                    gw.pool.mark_down(worker.id, f"broke mid-stream: {type(failure).__name__}")
                gw.metrics.completed(path, time.perf_counter() - started)

            stream = proxy.relay_stream(
                resp,
                on_first_byte=first_byte,
                on_end=end,
                on_cached_tokens=gw.metrics.actual_hit_tokens.inc,
                relay_samples=gw.relay_samples,
            )
            return proxy.streaming_response(resp, stream, extra)
        try:
            content = await proxy.read_or_cancel(request, resp)
        except UPSTREAM_ERRORS as exc:
            gw.pool.mark_down(worker.id, f"broke mid-response: {type(exc).__name__}")
            raise ApiError(502, f"engine failed mid-response: {exc}", "APIError") from None
        finally:
            gw.cp.finish(rid)
        if content is None:  # the client left: upstream closed, nothing to send
            return Response(status_code=499)
        elapsed = time.perf_counter() - started
        gw.metrics.first_byte(path, elapsed)
        gw.metrics.completed(path, elapsed)
        if resp.status == 200:
            cached = proxy.usage_cached_tokens(content)
            if cached is not None:
                gw.metrics.actual_hit_tokens.inc(cached)
        return proxy.passthrough_response(resp, content, extra)

    def _upstream_headers(
        self, request: Request, worker: Worker, route_request: RouteRequest
    ) -> dict[str, str]:
        """Forwarded headers; for a data-parallel engine, also vLLM's `X-data-parallel-rank`
        naming the rank that holds the longest prefix (its internal balancer would not
        know which one does)."""
        gw = self.gw
        headers = {k: v for k in proxy.FORWARDED_HEADERS if (v := request.headers.get(k))}
        if len(worker.sources) > 1 and len(route_request.content_keys):
            with gw.index_guard:
                matches = gw.cp.index.match(route_request.content_keys)
            best = max(
                (m for m in matches if m.worker == worker.id and m.blocks > 0),
                key=lambda m: m.blocks,
                default=None,
            )
            if best is not None:
                headers["x-data-parallel-rank"] = str(best.dp_rank)
        return headers
