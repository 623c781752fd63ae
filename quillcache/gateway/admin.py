"""The admin and debug API (`/admin/...`), behind the admin bearer token (`asgi.admin_only`).

Workers: list, add, get, remove, drain. Lookup: which worker holds how much of a prompt.
Index: stats, event sources, ingest counters and the gateway's own latency samples.
Pins: pin or unpin a prompt's prefix (a retention target of the policy engine).
Reset: an engine's prefix-cache reset, the one eviction engines offer; with `?tier=lmcache`
LMCache's `/clear` of the engine's LMCache instance (its controller attached).
Snapshot: the index image and every source's position, for a joining peer (`bootstrap`).
Decisions: the last sampled routing decisions, each beside its KV-optimal alternative.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import numpy as np
import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from quillcache.connectors import EventIngestor, SourcePosition
from quillcache.controlplane import ControlPlane, UnknownWorkerError
from quillcache.gateway.config import GatewayConfig, WorkerConfig
from quillcache.gateway.fleet import FleetLink
from quillcache.gateway.httpio import ApiError, json_object, validate_completion
from quillcache.gateway.identify import RequestIdentifier
from quillcache.gateway.lmcache_ctl import LmcacheError, indexed_medium
from quillcache.gateway.metrics import GatewayMetrics
from quillcache.gateway.outcomes import DecisionLog, LatencySamples
from quillcache.gateway.peer_snapshot import SnapshotHeader, SourceEntry, chunks, encode
from quillcache.gateway.pending import PendingEngines
from quillcache.gateway.policy_loop import PolicyEngine, ttl_of
from quillcache.gateway.tenancy import Identity, TenantPolicy, valid_tenant
from quillcache.gateway.workers import (
    DiscoveryError,
    DuplicateWorkerError,
    EventSourceError,
    Worker,
    WorkerPool,
)
from quillcache.index.native import NativeIndex
from quillcache.policy.targets import Target, TargetBudgetError, TargetKind
from quillcache.routing import Request as RouteRequest
from quillcache.state import PinRecord
from quillcache.tokenization.request import TokenizationError

log = logging.getLogger(__name__)

# The applier stops while the image is taken; a peer whose applier is this far behind
# would not answer in a useful time anyway.
SNAPSHOT_TAKE_TIMEOUT_S = 10.0
SNAPSHOT_BUSY_S = 120.0  # the longest one transfer may keep others waiting


class AdminApi:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        plane: ControlPlane,
        pool: WorkerPool,
        ingestor: EventIngestor,
        tenancy: TenantPolicy,
        identifier: RequestIdentifier,
        samples: LatencySamples,
        on_worker_added: Callable[[Worker], None],
        fleet: FleetLink | None = None,
        ready: Callable[[], bool] | None = None,
        metrics: GatewayMetrics | None = None,
        decisions: DecisionLog | None = None,
        policy: PolicyEngine | None = None,
        upstream: aiohttp.ClientSession | None = None,
        pending: PendingEngines | None = None,
    ) -> None:
        self.config = config
        self.pending = pending if pending is not None else PendingEngines()
        self.decisions = decisions if decisions is not None else DecisionLog()
        self.plane = plane
        self.pool = pool
        self.ingestor = ingestor
        self.tenancy = tenancy
        self.identifier = identifier
        self.samples = samples
        self.on_worker_added = on_worker_added
        self.fleet = fleet  # shared state: the changes below go to the whole fleet
        self.ready = ready  # whether /ready answers 200 (a snapshot is only served then)
        self.metrics = metrics
        self.policy = policy  # pins become its retention targets
        self.upstream = upstream  # admin actions on engines (reset)
        # one snapshot at a time (each holds a whole image): busy until this monotonic
        # time, or until its transfer ended (a client gone before the body started
        # never runs the body's cleanup, hence a deadline rather than a flag)
        self._snapshot_busy_until = 0.0

    async def workers(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse(
                {
                    # by id: engines that joined late are listed in their place
                    "workers": [w.as_dict() for _, w in sorted(self.pool.workers.items())],
                    # configured engines not described yet, retried (`pending.py`)
                    "pending": self.pending.as_list(),
                }
            )
        body = await self._body(request)
        try:
            cfg = WorkerConfig.model_validate(body)
        except ValueError as exc:
            raise ApiError(400, f"invalid worker: {exc}") from None
        if self.fleet is not None and cfg.kv_bind:
            raise ApiError(
                400,
                "kv_bind: true cannot work with a shared state (an engine publisher that "
                "connects to one gateway cannot serve several replicas): let the engine "
                "bind its KV-event socket and give its kv_endpoint, or leave it out",
            )
        try:
            w = await self.pool.add(cfg)
        except DuplicateWorkerError as exc:
            raise ApiError(409, str(exc), "ConflictError") from None
        except EventSourceError as exc:
            raise ApiError(409, str(exc), "ConflictError") from None
        except DiscoveryError as exc:
            raise ApiError(400, str(exc)) from None
        self.on_worker_added(w)
        for p in [p for p in self.pending.engines.values() if p.config.url == w.url]:
            self.pending.remove(p.worker_id)  # added by hand: it no longer joins on its own
        body = w.as_dict()
        if self.fleet is not None:
            body["shared"] = await self.fleet.engine_added(w)
        return JSONResponse(body, status_code=201)

    async def worker(self, request: Request) -> Response:
        if request.method == "DELETE":
            given = request.path_params["worker_id"]
            gone = self.pending.remove(int(given)) if given.isdigit() else None
            if gone is not None:  # a configured engine that never joined: no more retries
                return JSONResponse({"removed": gone.worker_id, "pending": True})
            removed = self._worker_call(request, self.pool.remove)
            if self.fleet is not None:
                shared = await self.fleet.engine_removed(removed)
                return JSONResponse({"removed": removed.id, "shared": shared})
            return JSONResponse({"removed": removed.id})
        given = request.path_params["worker_id"]
        waiting = self.pending.engines.get(int(given)) if given.isdigit() else None
        if waiting is not None:  # configured, not joined yet: what it waits for
            return JSONResponse({**waiting.as_dict(), "pending": True})
        return JSONResponse(self._worker_call(request, self.pool.get).as_dict())

    async def drain(self, request: Request) -> Response:
        body = await self._body(request, default=b"{}")
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise ApiError(400, "'draining' must be true or false")
        worker = self._worker_call(request, self.pool.get)
        self.pool.set_draining(worker.id, draining)
        body = worker.as_dict()
        if self.fleet is not None:
            body["shared"] = await self.fleet.drained(worker, draining)
        return JSONResponse(body)

    async def lookup(self, request: Request) -> Response:
        """Which worker holds how much of this prompt (body: a completion or chat body)."""
        keys = await self._keys_of(request)
        matches = self.plane.match(keys)
        bs = self.plane.block_size
        ranked = sorted(matches, key=lambda m: -m.blocks)
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
                    for m in ranked
                ],
            }
        )

    async def index(self, request: Request) -> Response:
        stats = self.plane.index_stats()
        samples = self.samples.by_name()
        response = JSONResponse(
            {
                "index": self.config.index,
                "secret": self.tenancy.secret.as_dict(),
                "tenants_isolated": self.tenancy.isolating,
                "blocks": stats.blocks,
                "resident_pairs": stats.resident_pairs,
                "sources": stats.sources,
                "memory_bytes": stats.memory_bytes,
                "extra": stats.extra,
                "event_sources": [s.as_dict() for s in self.ingestor.sources.values()],
                "ingest": vars(self.ingestor.stats()),
                **{name: percentiles_us(values) for name, values in samples.items()},
            }
        )
        if self.fleet is not None:
            response = JSONResponse(
                {**json.loads(bytes(response.body)), "shared_state": self.fleet.status()}
            )
        if request.query_params.get("reset_latency"):
            for values in samples.values():
                values.clear()
        return response

    async def decisions_log(self, request: Request) -> Response:
        """`GET /admin/decisions[?limit=N]`: the last N (default all kept) sampled
        decisions, oldest first, each with its explanation (docs/gateway.md)."""
        log_ = self.decisions
        raw = request.query_params.get("limit")
        limit = log_.capacity
        if raw is not None:
            try:
                limit = int(raw)
            except ValueError:
                limit = 0
            if not 1 <= limit <= log_.capacity:
                raise ApiError(400, f"limit must be an integer from 1 to {log_.capacity}")
        entries = list(log_.entries)[-limit:]
        return JSONResponse(
            {
                "capacity": log_.capacity,
                "sample_interval_s": log_.interval_s,
                "decisions": entries,
            }
        )

    async def pins(self, request: Request) -> Response:
        """`POST /admin/pins`: pin a prompt's prefix (a completion or chat body, plus an
        optional `ttl_s`) for the tenant the tenant header names, within its pin budget:
        the policy engine keeps it warm on its holders (placing it when none holds it)
        and routing prefers them while they have room. `DELETE`: unpin it (its owner
        only). `GET`: the pins and their holders (docs/policy.md)."""
        policy = self.policy
        if request.method == "GET":
            listed: list[dict[str, Any]] = []
            here: set[int] = set()  # the prefix keys of the pins this replica keeps warm
            if policy is not None:
                for t in policy.store:
                    if t.kind is TargetKind.PIN:
                        listed.append(policy.describe(t))
                        here.update(int(k) for k in t.keys[-1:])
            if self.fleet is not None:  # pins made through other replicas too
                listed += await self.fleet.pins_elsewhere(here)
            return JSONResponse({"pins": listed})
        body = await self._body(request)
        pin = request.method == "POST"
        cfg = self.config.policy
        try:
            ttl_s = ttl_of(body.pop("ttl_s", None), cfg.pin_default_ttl_s, cfg.pin_max_ttl_s)
        except ValueError as exc:
            raise ApiError(400, f"{exc} (policy.pin_max_ttl_s)", param="ttl_s") from None
        tenant, identity, model = self._namespace_of(request, body, served_only=pin)
        route_request, tokens = await self._identified(request, body, identity)
        keys = route_request.content_keys
        if not len(keys):
            raise ApiError(
                400,
                f"the prompt has no whole block to pin ({len(tokens)} tokens, blocks of "
                f"{self.plane.block_size})",
            )
        target = Target(
            kind=TargetKind.PIN,
            tenant=tenant,
            name=str(int(keys[-1])),
            keys=keys,
            token_ids=tokens[: len(keys) * self.plane.block_size],
            model=model,
            salt=identity.salt,
            expires_s=time.monotonic() + ttl_s,
        )
        if not pin:
            return JSONResponse(await self._unpin(target))
        if policy is not None:  # the budget first: nothing is pinned when it does not fit
            used = policy.store.tenant_tokens(TargetKind.PIN, tenant)
            old = policy.store.get(target.id)
            used -= old.tokens if old is not None else 0
            if used + target.tokens > policy.store.pin_budget_tokens:
                raise ApiError(
                    409,
                    f"tenant {tenant!r} pins {used} tokens; {target.tokens} more exceed its "
                    f"pin budget of {policy.store.pin_budget_tokens} (policy.pin_budget_tokens)",
                    "ConflictError",
                )
        out: dict[str, Any] = {"pinned": len(keys), "tokens": target.tokens, "ttl_s": ttl_s}
        if self.fleet is not None:
            record = PinRecord(target.model, target.salt, target.token_ids)
            shared = await self.fleet.pin(keys, tenant, ttl_s, record)
            if "owner" in shared:
                raise ApiError(
                    409,
                    f"the prefix is pinned by another tenant ({shared['owner']!r})",
                    "ConflictError",
                )
            out["shared"] = shared["shared"]
        if policy is not None:
            try:
                policy.retain(target)
            except TargetBudgetError as exc:
                raise ApiError(409, str(exc), "ConflictError") from None
            out["holders"] = sorted(self.plane.holders(keys))
        elif self.fleet is None:
            self.plane.pin(keys)
        return JSONResponse(out)

    async def sessions(self, request: Request) -> Response:
        """`GET /admin/sessions`: the sessions under retention (from requests' hints),
        each with its engine, holders and time left."""
        policy = self.policy
        listed = (
            []
            if policy is None
            else [policy.describe(t) for t in policy.store if t.kind is TargetKind.SESSION]
        )
        return JSONResponse({"sessions": listed})

    async def _unpin(self, target: Target) -> dict[str, Any]:
        keys = target.keys
        if self.fleet is not None:
            shared = await self.fleet.unpin(keys, target.tenant)
            if "owner" in shared:
                raise ApiError(
                    409,
                    f"the prefix is pinned by another tenant ({shared['owner']!r})",
                    "ConflictError",
                )
            if self.policy is not None:
                self.policy.release(target.id)
            return shared
        if self.policy is None:
            self.plane.unpin(keys)
            return {"unpinned": len(keys)}
        gone = self.policy.release(target.id)
        return {"unpinned": len(gone.keys) if gone is not None else 0}

    async def reset_prefix_cache(self, request: Request) -> Response:
        """`POST /admin/workers/{id}/reset_prefix_cache`: the engine drops its whole
        prefix cache (every tenant's): vLLM's `POST /reset_prefix_cache` (served with
        VLLM_SERVER_DEV_MODE=1), else SGLang's `POST /flush_cache`. An admin action only:
        no policy calls it. The index learns of it from the engine's AllBlocksCleared.

        `?tier=lmcache` (`&location=`, default the controller settings' location):
        LMCache's `POST /clear` of the engine's LMCache instance through its controller:
        every tenant's unpinned chunks of that location. In-process LMCache reports no
        removal, so the index keeps that residency until the engine's events say
        otherwise (a predicted CPU hit the engine may not have, never a wrong answer)."""
        worker = self._worker_call(request, self.pool.get)
        tier = request.query_params.get("tier", "gpu")
        if tier == "lmcache":
            return await self._clear_lmcache(worker, request.query_params.get("location"))
        if tier != "gpu":
            raise ApiError(
                400, f"tier must be 'gpu' (the engine's reset) or 'lmcache', got {tier!r}"
            )
        session = self.upstream
        if session is None:
            raise ApiError(503, "no upstream session", "ServiceUnavailableError")
        timeout = aiohttp.ClientTimeout(total=self.config.policy.timeout_s)
        tried = []
        for path in ("/reset_prefix_cache", "/flush_cache"):
            try:
                async with session.post(worker.url + path, timeout=timeout) as resp:
                    text = (await resp.read()).decode("utf-8", "replace")[:300]
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise ApiError(
                    502,
                    f"engine {worker.url} did not answer {path}: {type(exc).__name__}",
                    "APIConnectionError",
                ) from None
            if status in (404, 405):
                tried.append(path)
                continue
            if status != 200:
                raise ApiError(
                    409,
                    f"engine {worker.url} refused {path} ({status}): {text}",
                    "ConflictError",
                )
            return JSONResponse({"worker": worker.id, "reset": path})
        raise ApiError(
            409,
            f"engine {worker.url} offers no prefix-cache reset ({', '.join(tried)} not found; "
            "vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1)",
            "ConflictError",
        )

    async def _clear_lmcache(self, worker: Worker, location: str | None) -> Response:
        controller = self.policy.lmcache if self.policy is not None else None
        if controller is None:
            raise ApiError(
                409, "no LMCache controller is attached to the policy engine", "ConflictError"
            )
        instance = controller.instance_of(worker.url)
        if instance is None:
            raise ApiError(
                409,
                f"engine {worker.url} is no LMCache instance of the controller "
                "(lmcache.instances names none for its URL)",
                "ConflictError",
            )
        where = location or controller.settings.location
        try:
            event, tokens = await controller.clear(instance, where)
        except LmcacheError as exc:
            if exc.status == 0:
                raise ApiError(
                    502,
                    f"LMCache's controller did not answer /clear: {exc.detail}",
                    "APIConnectionError",
                ) from None
            raise ApiError(
                409,
                f"LMCache's controller refused /clear of {instance!r} ({exc.status}): {exc.detail}",
                "ConflictError",
            ) from None
        # LMCache reports no removal for what /clear drops: the index forgets the tier
        # itself, on the applier thread, in order with the engine's events
        medium = indexed_medium(where)
        dropped = 0
        if medium is not None:
            plane, worker_id = self.plane, worker.id
            dropped = await asyncio.wrap_future(
                self.ingestor.on_applier(lambda: plane.clear_medium(worker_id, medium))
            )
        log.info(
            "admin: LMCache /clear of engine %d (instance %r, %s): %d tokens, %d blocks "
            "of medium %s dropped from the index",
            worker.id,
            instance,
            where,
            tokens,
            dropped,
            medium,
        )
        return JSONResponse(
            {
                "worker": worker.id,
                "reset": "/clear",
                "lmcache_instance": instance,
                "location": where,
                "event_id": event,
                "tokens": tokens,
                # what the index held of that tier and no longer does
                "index_medium": medium,
                "index_blocks_dropped": dropped,
            }
        )

    async def snapshot(self, request: Request) -> Response:
        """`GET /admin/snapshot`: this replica's index image and, per event source, the
        last applied seq and that batch's digest, taken together on the applier thread
        (`peer_snapshot` has the format, `bootstrap` the reader). Only from a replica
        that is ready (its image is complete) with the in-memory native index; one at
        a time (429 while another is being taken or sent)."""
        index = self.plane.index
        if type(index) is not NativeIndex:
            self._served("unsupported")
            raise ApiError(
                409,
                f"index backend {self.config.index!r} has no peer snapshot (index: native has)",
                "ConflictError",
            )
        if self.ready is not None and not self.ready():
            self._served("not_ready")
            raise ApiError(
                503,
                "this replica is not ready (its index has not caught up): ask another peer",
                "ServiceUnavailableError",
            )
        if time.monotonic() < self._snapshot_busy_until:
            self._served("busy")
            raise ApiError(429, "a snapshot is being taken or sent: retry", "RateLimitError")
        self._snapshot_busy_until = time.monotonic() + SNAPSHOT_BUSY_S

        def take() -> tuple[bytes, SnapshotHeader]:
            """On the applier thread: the image, the seqs it holds and the workers it
            registers, at one point (reads only: the event loop may go on meanwhile)."""
            image = index.snapshot()
            return image, self._header(index.stats().blocks, self.ingestor.positions())

        try:
            image, header = await asyncio.wait_for(
                asyncio.wrap_future(self.ingestor.on_applier(take)), SNAPSHOT_TAKE_TIMEOUT_S
            )
            parts = encode(header, image)
        except BaseException as exc:
            self._snapshot_busy_until = 0.0
            if isinstance(exc, TimeoutError):
                self._served("timeout")
                raise ApiError(
                    503, "the event applier did not take the snapshot in time: retry",
                    "ServiceUnavailableError",
                ) from None  # fmt: skip
            raise
        size = sum(len(p) for p in parts)

        async def body() -> Any:
            try:
                for piece in chunks(parts):
                    yield piece
                self._served("served", size)
            finally:
                self._snapshot_busy_until = 0.0

        return StreamingResponse(
            body(),
            media_type="application/octet-stream",
            headers={"content-length": str(size), "x-quillcache-snapshot-format": "1"},
        )

    def _header(self, blocks: int, positions: list[SourcePosition]) -> SnapshotHeader:
        """Every rank the index registers (the pool's workers), with its position: a
        rank the joiner cannot take is listed too, so that it can drop its residency."""
        at = {(p.worker, p.dp_rank): p for p in positions}
        sources = []
        for w in list(self.pool.workers.values()):
            for rank in range(self.plane.worker(w.id).dp_ranks):
                p = at.get((w.id, rank))
                if p is None:
                    why = "no event source"
                elif not w.healthy:
                    why = "engine down"
                else:
                    why = p.why
                sources.append(
                    SourceEntry(
                        worker=w.id,
                        url=w.url,
                        dp_rank=rank,
                        endpoint=p.endpoint if p else "",
                        replay_endpoint=p.replay_endpoint if p else None,
                        last_seq=p.last_seq if p else -1,
                        digest=p.digest if p else None,
                        exact=not why,
                        why=why,
                    )
                )
        return SnapshotHeader(
            secret_fingerprint=self.tenancy.secret.fingerprint,
            block_size=self.plane.block_size,
            tokenizer_id=self.config.tokenizer_id,
            created_unix=time.time(),
            blocks=blocks,
            sources=sources,
        )

    def _served(self, outcome: str, size: int = 0) -> None:
        if self.metrics is not None:
            self.metrics.snapshots_served.labels(outcome).inc()
            self.metrics.snapshot_bytes_served.inc(size)
        if outcome != "served":
            log.warning("peer snapshot not served: %s", outcome)

    # -- shared steps --------------------------------------------------------------------

    async def _body(self, request: Request, default: bytes = b"") -> dict[str, Any]:
        return await json_object(request, self.config.max_body_bytes, default)

    def _worker_call(self, request: Request, call: Any) -> Worker:
        """`call(worker_id)` with the id of the path; 404 for a bad or unknown id."""
        given = request.path_params["worker_id"]
        try:
            worker_id = int(given)
        except ValueError:
            raise ApiError(
                404, f"no worker {given!r}: worker ids are whole numbers", "NotFoundError"
            ) from None
        try:
            return call(worker_id)
        except (ValueError, UnknownWorkerError) as exc:
            raise ApiError(404, str(exc), "NotFoundError") from None

    def _namespace_of(
        self, request: Request, body: dict[str, Any], *, served_only: bool
    ) -> tuple[str, Identity, str]:
        """The checked body's tenant (named by the tenant header: the admin token vouches
        for it, as a trusted proxy would), namespace identity and model; `served_only`: a
        model no engine serves is a 404 (a pin nobody could hold; an unpin still goes
        through, for a pin whose engines have left)."""
        validate_completion(body, "messages" in body)
        tenancy = self.tenancy
        tenant = request.headers.get(tenancy.tenant_header, "")
        if tenant and not valid_tenant(tenant):
            raise ApiError(400, f"the {tenancy.tenant_header} header is not a valid tenant")
        identity = tenancy.identity(tenant, body.get("cache_salt"))
        model = body.get("model")
        if not isinstance(model, str) or not model:
            served = sorted(self.pool.models())
            if len(served) != 1:
                raise ApiError(400, f"name the 'model' (served: {', '.join(served)})")
            model = served[0]
        served_models = self.pool.models()
        if served_only and served_models and model not in served_models:
            # a pin or prefetch nobody can hold (as a completion for it gets)
            raise ApiError(
                404,
                f"The model `{model}` does not exist; served: {', '.join(sorted(served_models))}",
                "NotFoundError",
                code="model_not_found",
                param="model",
            )
        return tenant, identity, model

    async def _identified(
        self, request: Request, body: dict[str, Any], identity: Identity
    ) -> tuple[RouteRequest, list[int]]:
        try:
            return await self.identifier.identify_tokens(body, "messages" in body, {}, identity)
        except (TokenizationError, ValueError, TypeError) as exc:
            raise ApiError(400, f"cannot tokenize: {exc}") from None

    async def _keys_of(self, request: Request) -> npt.NDArray[np.uint64]:
        """The content keys of the completion or chat body of `request`, in the namespace
        a completion request would get: the tenant named by the tenant header (the admin
        token vouches for it, as a trusted proxy would) and the body's `cache_salt`."""
        body = await self._body(request)
        chat = "messages" in body
        validate_completion(body, chat)
        tenancy = self.tenancy
        tenant = request.headers.get(tenancy.tenant_header, "")
        if tenant and not valid_tenant(tenant):
            raise ApiError(400, f"the {tenancy.tenant_header} header is not a valid tenant")
        identity = tenancy.identity(tenant, body.get("cache_salt"))
        try:
            route_request, _ = await self.identifier.identify(body, chat, {}, identity)
        except (TokenizationError, ValueError, TypeError) as exc:
            raise ApiError(400, f"cannot tokenize: {exc}") from None
        return route_request.content_keys


def percentiles_us(samples: collections.deque[float]) -> dict[str, float]:
    if not samples:
        return {}
    values = np.fromiter(samples, dtype=np.float64) * 1e6
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "n": float(len(values))}
