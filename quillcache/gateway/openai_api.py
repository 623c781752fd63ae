"""The OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`.

A proxied request: check the API key, read and check the body, derive its content keys
(`RequestIdentifier`), route, forward (once more elsewhere when the connect fails), and
relay the answer (`proxy`). Every answer, error or not, is counted by endpoint and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache.controlplane import ControlPlane, RouterContractError
from quillcache.controlplane.admission import effective_slo, missed
from quillcache.errors import QuillCacheError
from quillcache.gateway import proxy
from quillcache.gateway.config import GatewayConfig
from quillcache.gateway.httpio import (
    ApiError,
    check_context,
    check_prompt_bytes,
    parse_object,
    read_body,
    single_headers,
    validate_completion,
)
from quillcache.gateway.identify import RequestIdentifier
from quillcache.gateway.outcomes import RequestOutcomes
from quillcache.gateway.parent_hints import CLIENT_ID_HEADER, PARENT_HEADER, check_parent_headers
from quillcache.gateway.policy_loop import PolicyEngine
from quillcache.gateway.session_hints import TTL_HEADER, SessionHint, read_session_hint
from quillcache.gateway.shared_routing import SharedRouting
from quillcache.gateway.slo import (
    EXTENSION,
    TBT_HEADER,
    TTFT_HEADER,
    SloPolicy,
    SloRejected,
    read_hints,
    read_priority,
)
from quillcache.gateway.slo_queue import SloQueue
from quillcache.gateway.tenancy import Identity, TenantPolicy
from quillcache.gateway.workers import GATEWAY_HEADER, Worker, WorkerPool
from quillcache.routing import SLO, Action, default_slo
from quillcache.routing import Request as RouteRequest
from quillcache.tokenization.request import EngineUnreachable, TokenizationError

log = logging.getLogger(__name__)

_CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
WORKER_HEADER = "x-quillcache-worker"


class EngineError(ApiError):
    """An engine's failure: the error names the engine in `x-quillcache-worker`, as
    every answer that engine gave does."""

    def __init__(self, worker: Worker, status: int, message: str, kind: str = "APIError") -> None:
        super().__init__(status, message, kind)
        self.worker_id = worker.id

    def response(self) -> JSONResponse:
        response = super().response()
        response.headers[WORKER_HEADER] = str(self.worker_id)
        return response


@dataclass(slots=True)
class Prepared:
    """A checked, tokenized request, ready to route."""

    raw: bytes  # the body to forward, with the derived cache_salt (or none)
    route_request: RouteRequest
    prompt_tokens: int
    candidates: frozenset[int] | None  # engines serving its model; None = any
    routing_started: float  # perf_counter() when tokenizing began
    priority: int = 0  # its place in the SLO queue (`slo_admission: queue`), lower first
    # a session retention hint (`session_hints`), with the prompt's tokens it retains
    retention: SessionHint | None = None
    tokens: list[int] | None = None
    model: str = ""
    identity: Identity | None = None
    # the request's own SLO as prepared: the SLO queue narrows `route_request.slo` while
    # it waits, and a retry elsewhere starts again from this
    own_slo: SLO | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.own_slo = self.route_request.slo


@contextlib.contextmanager
def _tokenize_errors() -> Iterator[None]:
    """Tokenizing failures as the client's (400) or the engines' (503) errors."""
    try:
        yield
    except EngineUnreachable as exc:  # dead engines, not a bad request
        raise ApiError(
            503, f"cannot tokenize the request: {exc}", "ServiceUnavailableError"
        ) from None
    except TokenizationError as exc:
        raise ApiError(400, f"cannot tokenize the request: {exc}") from None
    except (ValueError, TypeError, QuillCacheError) as exc:  # e.g. HashingError
        raise ApiError(400, f"invalid prompt: {exc}") from None


class OpenAIEndpoints:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        plane: ControlPlane,
        pool: WorkerPool,
        tenancy: TenantPolicy,
        identifier: RequestIdentifier,
        outcomes: RequestOutcomes,
        upstream: aiohttp.ClientSession,
        peer_of: Callable[[Request], str | None],
        policy: PolicyEngine | None = None,
    ) -> None:
        self.config = config
        self.plane = plane
        self.pool = pool
        self.tenancy = tenancy
        self.identifier = identifier
        self.outcomes = outcomes
        self.upstream = upstream
        self.peer_of = peer_of
        self.policy = policy  # takes session retention hints
        # the hints a request gives in headers: each one value at most
        self._hint_headers = (
            config.session_header,
            TTL_HEADER,
            TTFT_HEADER,
            TBT_HEADER,
            CLIENT_ID_HEADER,
            PARENT_HEADER,
        )
        # `--state redis`: every decision is booked in the fleet's shared state (None: local)
        self.shared: SharedRouting | None = None
        # clients' SLO hints against the default SLO of the plane's router (gateway/slo.py)
        self.slo = SloPolicy(
            config.slo_hints,
            frozenset(config.slo_trusted_tenants),
            default_slo(plane.router),
            config.slo_max_ms,
        )
        # `slo_admission: queue`: requests the admission stage refuses wait here
        self.slo_queue: SloQueue[tuple[Worker, int, float]] | None = (
            SloQueue(config.slo_queue_max, config.slo_queue_tick_s)
            if config.slo_admission == "queue"
            else None
        )

    async def completions(self, request: Request) -> Response:
        return await self._counted(request, COMPLETIONS, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._counted(request, CHAT_COMPLETIONS, chat=True)

    async def models(self, request: Request) -> Response:
        self.authenticate(request.headers, self.peer_of(request))
        now = int(time.time())
        data = [
            {
                "id": name,
                "object": "model",
                "created": now,
                "owned_by": "quillcache",
                "parent": self.identifier.base_model_of(name) if lora else None,
            }
            for name, lora in sorted(self.pool.models().items())
        ]
        # a gateway is never taken for an engine (`Worker.describe`)
        return JSONResponse({"object": "list", "data": data}, headers={GATEWAY_HEADER: "1"})

    # -- one proxied request -------------------------------------------------------------

    async def _counted(self, request: Request, path: str, *, chat: bool) -> Response:
        try:
            response = await self._proxy(request, path, chat=chat)
        except ApiError as exc:
            response = exc.response()
        self.outcomes.answered(path, response.status_code)
        return response

    def authenticate(self, headers: Headers, peer: str | None) -> str:
        """The request's tenant ("" = the shared namespace), or a 401/403 ApiError (a
        400 for a tenant or key header given twice with different values)."""
        single_headers(headers, ("authorization", self.tenancy.tenant_header))
        return self.tenancy.authenticate(headers, peer)

    async def prepare(self, headers: Headers, raw: bytes, chat: bool, tenant: str) -> Prepared:
        """Check the body (`tenant` authenticated already), then tokenize and hash it for
        routing. Shared by both data paths (this ASGI app's and the native relay's)."""
        size = len(raw)
        body, raw, candidates, identity, slo, retention = self._checked(headers, raw, chat, tenant)
        check_prompt_bytes(body, chat, size, self.config.max_prompt_bytes)
        routing_started = time.perf_counter()  # tokenize + hash + route, for /admin/index
        with _tokenize_errors():
            route_request, tokens = await self.identifier.identify_tokens(
                body, chat, headers, identity, candidates
            )
        return self._prepared(
            raw,
            body,
            route_request,
            tokens,
            candidates,
            routing_started,
            tenant,
            identity,
            slo,
            retention,
        )

    def _prepared(
        self,
        raw: bytes,
        body: dict[str, Any],
        route_request: RouteRequest,
        tokens: list[int],
        candidates: frozenset[int] | None,
        routing_started: float,
        tenant: str,
        identity: Identity,
        slo: SLO | None,
        retention: SessionHint | None,
    ) -> Prepared:
        """A tokenized request within its engines' context, ready to route; with the
        prompt's tokens and owner when the policy engine keeps them once it is routed (a
        retention hint retains them; replication copies hot prefixes from them)."""
        check_context(len(tokens), self.pool.context_limit(candidates))
        route_request.slo = slo
        prepared = Prepared(
            raw,
            route_request,
            len(tokens),
            candidates,
            routing_started,
            self._priority(body, tenant),
        )
        if retention is not None or self._hot_tokens:
            prepared.retention, prepared.tokens = retention, tokens
            prepared.model, prepared.identity = str(body.get("model") or ""), identity
        return prepared

    @property
    def _hot_tokens(self) -> bool:
        return self.policy is not None and self.policy.wants_tokens

    def prepare_now(self, headers: Headers, raw: bytes, chat: bool, tenant: str) -> Prepared | None:
        """`prepare` without awaiting when the gateway tokenizes locally, else None (the
        native relay then decides in a task: one event-loop turn less per request)."""
        if not self.identifier.tokenizes_locally:
            return None
        size = len(raw)
        body, raw, candidates, identity, slo, retention = self._checked(headers, raw, chat, tenant)
        check_prompt_bytes(body, chat, size, self.config.max_prompt_bytes)
        routing_started = time.perf_counter()
        with _tokenize_errors():
            identified = self.identifier.identify_now(body, chat, headers, identity)
        assert identified is not None
        route_request, tokens = identified
        return self._prepared(
            raw,
            body,
            route_request,
            tokens,
            candidates,
            routing_started,
            tenant,
            identity,
            slo,
            retention,
        )

    def _priority(self, body: dict[str, Any], tenant: str) -> int:
        """The request's place in the SLO queue: the body's `priority` (vLLM's field, kept
        for the engine) as the trust policy lets it count; 0 without a queue. Checked
        either way: one that is not an integer is a 400 here, not the engine's."""
        priority = read_priority(body)
        if self.slo_queue is None:
            return 0
        return self.slo.priority(priority, tenant)

    def _checked(
        self, headers: Headers, raw: bytes, chat: bool, tenant: str
    ) -> tuple[
        dict[str, Any], bytes, frozenset[int] | None, Identity, SLO | None, SessionHint | None
    ]:
        """The body as an object, its raw form to forward (with the derived salt, without
        the gateway's extensions), the engines serving it, its namespace identity, its
        own SLO (`Request.slo`: the client's hints as `slo_hints` lets them count) and
        its session retention hint."""
        body = parse_object(raw)
        validate_completion(body, chat)
        extended = EXTENSION in body or "nvext" in body
        single_headers(headers, self._hint_headers)
        check_parent_headers(headers)
        retention = read_session_hint(
            headers, body, self.config.session_header, self.config.policy.session_max_ttl_s
        )
        slo = self.slo.apply(read_hints(headers, body, self.slo.max_ms), tenant)
        identity = self.tenancy.identity(tenant, body.get("cache_salt"))
        model = body.get("model")
        candidates = self.pool.serving(model)  # only engines serving the model (or adapter)
        if candidates is not None and not candidates:
            known = ", ".join(sorted(self.pool.models()))
            raise ApiError(
                404,
                f"The model `{model}` does not exist; served: {known}",
                "NotFoundError",
                code="model_not_found",
                param="model",
            )
        # The engine isolates by the salt the gateway derived, never by the client's.
        if identity.salt is not None:
            body["cache_salt"] = identity.salt
            raw = json.dumps(body).encode()
        elif "cache_salt" in body:  # an empty or null salt: no salt at all
            del body["cache_salt"]
            raw = json.dumps(body).encode()
        elif extended:  # the gateway's own field, not the engine's
            raw = json.dumps(body).encode()
        return body, raw, candidates, identity, slo, retention

    async def _proxy(self, request: Request, path: str, *, chat: bool) -> Response:
        started = time.perf_counter()
        tenant = self.authenticate(request.headers, self.peer_of(request))
        raw = await read_body(request, self.config.max_body_bytes)
        prepared = await self.prepare(request.headers, raw, chat, tenant)
        route_request = prepared.route_request
        # From here on a client that hangs up cancels this task: the upstream request is
        # dropped whether the engine is still computing (no headers yet: a non-streamed
        # answer only comes when complete) or its body is being read.
        watch = proxy.DisconnectWatch(request)
        try:
            return await self._forward(request, path, prepared, watch, started)
        except asyncio.CancelledError:
            if not watch.client_left:
                raise  # cancelled for another reason: propagate
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            self.outcomes.client_left(route_request.request_id)  # finish is idempotent
            return Response(status_code=499)  # nobody reads it; counted by the caller
        finally:
            watch.stop()

    async def _forward(
        self,
        request: Request,
        path: str,
        prepared: Prepared,
        watch: proxy.DisconnectWatch,
        started: float,
    ) -> Response:
        """Route, send upstream (once more elsewhere when the connect fails or the engine
        hangs before its first byte), answer."""
        route_request, outcomes = prepared.route_request, self.outcomes
        rid = route_request.request_id
        for attempt in range(2):
            worker, dp_rank, first_byte_s = await self.route_booked(prepared)
            outcomes.forwarding(time.perf_counter() - started)
            # The first byte: a whole answer's head, or a stream's first chunk (its head
            # comes before the prefill). Until then the client has nothing: a retry is safe.
            first_byte = asyncio.timeout(first_byte_s)
            first: bytes | None = None
            try:
                async with first_byte:
                    resp = await self.upstream.post(
                        worker.url + path,
                        data=prepared.raw,
                        headers=self.upstream_headers(request.headers, worker, dp_rank),
                    )
                    if resp.status == 200 and proxy.is_stream(resp):
                        try:
                            first = await resp.content.readany()
                        except BaseException:
                            resp.close()
                            raise
            except _CONNECT_ERRORS as exc:
                # the down worker is not routable any more: retry elsewhere, once
                why = f"connect failed: {type(exc).__name__}"
                outcomes.engine_failed(rid, worker.id, why, retry=attempt == 0)
                if attempt == 0:
                    continue
                raise EngineError(
                    worker, 502, f"engine {worker.url} unreachable: {exc}", "APIConnectionError"
                ) from None
            except UPSTREAM_ERRORS as exc:
                if not first_byte.expired():
                    outcomes.released(rid)
                    raise EngineError(
                        worker, 502, f"engine {worker.url} failed: {type(exc).__name__}"
                    ) from None
                why = f"hung: no first byte within {first_byte_s:.1f} s"
                outcomes.engine_failed(rid, worker.id, why, retry=attempt == 0)
                if attempt == 0:
                    continue
                raise EngineError(
                    worker,
                    504,
                    f"engine {worker.url} sent nothing within {first_byte_s:.1f} s",
                    "APITimeoutError",
                ) from None
            return await self._respond(
                request, path, resp, first, worker, route_request, started, watch
            )
        raise AssertionError("unreachable")

    def route(
        self, prepared: Prepared, *, count_slo_miss: bool = True
    ) -> tuple[Worker, int, float]:
        """Route one request among its candidates (None: any worker; raises the 503/429
        of a rejection) and count the decision. Returns the worker, its dp rank that
        serves the request and how long it may take to send the first byte
        (`first_byte_limit`). `count_slo_miss=False`: an SLO miss is raised uncounted
        (the SLO queue retries it, and counts only the final refusal)."""
        route_request = prepared.route_request
        candidates, prompt_tokens = prepared.candidates, prepared.prompt_tokens
        rid = route_request.request_id
        try:
            # every decision is explained (the regret counters); a sampled one lists its
            # candidates for /admin/decisions
            decision = self.plane.route(
                route_request,
                now_s=time.monotonic(),
                only=candidates,
                explain=True,
                candidates=self.outcomes.decisions.sample(),
            )
        except RouterContractError as exc:
            log.error("gateway: %s", exc)
            self.outcomes.not_routed(rid, "router error", None)
            raise ApiError(500, f"routing failed: {exc}", "InternalServerError") from None
        routed_s = time.perf_counter() - prepared.routing_started
        if decision.rejected or decision.worker is None:
            reason = decision.reason or "rejected"
            miss = missed(route_request, decision, self.slo.default)
            if miss is not None:
                refused = SloRejected(miss, reason)
                if count_slo_miss:
                    self.slo_refused(rid, refused, routed_s)
                raise refused
            self.outcomes.not_routed(rid, reason, routed_s, decision.explanation)
            if "no routable worker" in reason:
                raise ApiError(503, f"request not routed: {reason}", "ServiceUnavailableError")
            raise ApiError(429, f"request not routed: {reason}", "RateLimitError")
        worker = self.pool.get(decision.worker)
        # (blocks_by_action builds a dict over the whole Action enum, too costly per request)
        cached_blocks = sum(step.blocks for step in decision.plan if step.action == Action.REUSE)
        cached_tokens = min(cached_blocks * self.plane.block_size, prompt_tokens)
        self.outcomes.routed(
            worker.id,
            decision.reason or "chosen",
            routed_s,
            cached_tokens,
            prompt_tokens,
            request_id=rid,
            explanation=decision.explanation,
            parent_id=route_request.parent_id,
        )
        dp_rank = decision.dp_rank if decision.dp_rank is not None else 0
        self._retain(prepared, worker)
        if self.policy is not None and prepared.tokens is not None:
            assert prepared.identity is not None
            self.policy.routed(  # hot-prefix heat (policy_loop.PolicyEngine.routed)
                route_request.content_keys,
                prepared.tokens,
                tenant=prepared.identity.tenant,
                salt=prepared.identity.salt,
                model=prepared.model,
            )
        return worker, dp_rank, self.first_byte_limit(route_request, cached_tokens)

    def slo_refused(self, rid: int | str, refused: SloRejected, routed_s: float) -> None:
        """Count and log a 429 of the admission stage."""
        miss = refused.miss
        # a fixed label: the reason's figures would make a series per request
        self.outcomes.not_routed(rid, f"slo: {miss.bound} estimate over", routed_s)
        self.outcomes.metrics.slo_rejected(miss.bound)
        log.info(
            "gateway: request %s not admitted (429, Retry-After %d s): %s",
            rid,
            miss.retry_after_s,
            refused.reason,
        )

    async def admitted(self, prepared: Prepared) -> tuple[Worker, int, float]:
        """`route`, and with the SLO queue, a request refused while waiting could help
        waits there (`slo_queue`) against what is left of its SLO."""
        queue = self.slo_queue
        if queue is None:
            return self.route(prepared)
        rr = prepared.route_request
        rr.slo = prepared.own_slo
        try:
            return self.route(prepared, count_slo_miss=False)
        except SloRejected as first:
            if not first.miss.waiting_helps or queue.full():
                routed_s = time.perf_counter() - prepared.routing_started
                self.slo_refused(rr.request_id, first, routed_s)
                raise
        slo = effective_slo(rr, self.slo.default)
        assert slo is not None and slo.ttft_s is not None  # only TTFT misses can wait
        ttft_s = slo.ttft_s

        def attempt() -> tuple[Worker, int, float] | None:
            waited = time.perf_counter() - prepared.routing_started
            rr.slo = SLO(ttft_s=ttft_s - waited, tbt_s=slo.tbt_s)
            try:
                return self.route(prepared, count_slo_miss=False)
            except SloRejected as exc:
                if exc.miss.waiting_helps:
                    return None
                final = SloRejected(
                    exc.miss, f"{exc.reason} (left of its SLO after {waited:.3f}s queued)"
                )
                self.slo_refused(rr.request_id, final, waited)
                raise final from None

        return await queue.wait(prepared.priority, attempt)

    async def route_booked(
        self, prepared: Prepared, *, cancellable: bool = True
    ) -> tuple[Worker, int, float]:
        """`route` (through the SLO queue when there is one: `admitted`), then with
        shared state the booking in Redis, which may move the request to another
        candidate of the router's shortlist (`shared_routing`). `cancellable=False`:
        the caller's task is never cancelled (the native relay)."""
        worker, dp_rank, first_byte_s = await self.admitted(prepared)
        shared = self.shared
        if shared is None:
            return worker, dp_rank, first_byte_s
        try:
            booked = await shared.book(
                prepared.route_request, worker.id, dp_rank, cancellable=cancellable
            )
        except BaseException:
            self.outcomes.released(prepared.route_request.request_id)
            raise
        moved = booked.moved and booked.worker in self.pool.workers
        if moved:
            worker, dp_rank = self.pool.get(booked.worker), booked.rank
        # its prefix is being computed where it was booked (the router's choice or not)
        self.plane.booked(prepared.route_request.request_id, worker.id, dp_rank)
        if moved:
            self._retain(prepared, worker)  # the session is bound where it really went
        return worker, dp_rank, first_byte_s

    def _retain(self, prepared: Prepared, worker: Worker) -> None:
        """A session hint: the policy engine keeps this prompt warm on `worker` and
        routes the session's next turn there (`policy_loop.PolicyEngine.session_turn`)."""
        hint, policy = prepared.retention, self.policy
        if hint is None or policy is None or prepared.tokens is None:
            return
        assert prepared.identity is not None
        policy.session_turn(
            hint,
            tenant=prepared.identity.tenant,
            salt=prepared.identity.salt,
            model=prepared.model,
            keys=prepared.route_request.content_keys,
            tokens=prepared.tokens,
            engine=worker.id,
        )

    def first_byte_limit(self, route_request: RouteRequest, cached_tokens: int) -> float:
        """How long an engine may take before its first byte without counting as hung:
        `first_byte_multiplier` times the cost model's estimate of the work before it,
        never less than `first_byte_timeout_s` nor more than `request_timeout_s`.

        The estimate is the prefill of the uncached tokens (a long prompt legitimately
        takes seconds) plus the decode of the expected output: a whole answer's head
        only comes once it is complete. For a stream that overestimates by the decode,
        which only makes the limit looser; the gateway does not parse `stream`."""
        cfg, cost = self.config, self.plane.cost
        prompt = route_request.prompt_tokens
        new = max(prompt - cached_tokens, 1)
        expected = cost.prefill_time(new, prompt - new)
        expected += route_request.expected_output_tokens * cost.decode_step_time(1, prompt)
        limit = max(cfg.first_byte_timeout_s, cfg.first_byte_multiplier * expected)
        return min(limit, cfg.request_timeout_s)

    async def _respond(
        self,
        request: Request,
        path: str,
        resp: aiohttp.ClientResponse,
        first: bytes | None,
        worker: Worker,
        route_request: RouteRequest,
        started: float,
        watch: proxy.DisconnectWatch,
    ) -> Response:
        """Relay the answer; `first` is a stream's first chunk, already read."""
        outcomes, rid = self.outcomes, route_request.request_id
        extra = {WORKER_HEADER: str(worker.id)}
        stall_s = self.config.stall_timeout_s
        if first is not None:
            watch.stop()  # the relay watches the client from here on

            def first_byte() -> None:
                outcomes.first_byte(path, time.perf_counter() - started, rid)

            def end(failure: BaseException | None) -> None:
                broke = (
                    f"broke mid-stream: {type(failure).__name__}"
                    if isinstance(failure, UPSTREAM_ERRORS)
                    else None
                )
                # otherwise cancelled or closed: the client went away
                client_left = broke is None and failure is not None
                elapsed = time.perf_counter() - started
                outcomes.ended(path, rid, worker.id, elapsed, broke=broke, client_left=client_left)

            stream = proxy.relay_stream(
                resp,
                first,
                stall_s=stall_s,
                on_first_byte=first_byte,
                on_end=end,
                on_cached_tokens=outcomes.cached_tokens,
                relay_samples=outcomes.samples.relay,
            )
            return proxy.streaming_response(resp, stream, extra)
        try:
            content = await proxy.read_all(resp, stall_s)  # `watch` cancels it if the client leaves
        except UPSTREAM_ERRORS as exc:
            outcomes.engine_broke(worker.id, f"broke mid-response: {type(exc).__name__}")
            reason = "stall timeout" if isinstance(exc, TimeoutError) else str(exc)
            raise EngineError(
                worker, 502, f"engine failed mid-response: {reason or type(exc).__name__}"
            ) from None
        except asyncio.CancelledError:
            resp.close()  # dropping the connection is how the engine learns
            raise
        finally:
            resp.release()
            outcomes.answer_over(rid, worker.id)
        outcomes.whole_answer(path, time.perf_counter() - started)
        if resp.status == 200:
            cached = proxy.usage_cached_tokens(content)
            if cached is not None:
                outcomes.cached_tokens(cached)
        return proxy.passthrough_response(resp, content, extra)

    def upstream_headers(
        self, headers: Mapping[str, str], worker: Worker, dp_rank: int
    ) -> dict[str, str]:
        """Forwarded headers; for a data-parallel engine, also vLLM's `X-data-parallel-rank`
        naming the rank the decision chose (each rank is a routing row of its own: the
        engine's internal balancer knows neither the ranks' caches nor the fleet)."""
        forwarded = {k: v for k in proxy.FORWARDED_HEADERS if (v := headers.get(k))}
        if self.plane.worker(worker.id).dp_ranks > 1:
            forwarded["x-data-parallel-rank"] = str(dp_rank)
        return forwarded
