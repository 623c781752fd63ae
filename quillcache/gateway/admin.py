"""The admin and debug API (`/admin/...`), behind the admin bearer token (`asgi.admin_only`).

Workers: list, add, get, remove, drain. Lookup: which worker holds how much of a prompt.
Index: stats, event sources, ingest counters and the gateway's own latency samples.
Pins: pin or unpin the blocks of a prompt.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache.connectors import EventIngestor
from quillcache.controlplane import ControlPlane, UnknownWorkerError
from quillcache.gateway.config import GatewayConfig, WorkerConfig
from quillcache.gateway.fleet import FleetLink
from quillcache.gateway.httpio import ApiError, json_object, validate_completion
from quillcache.gateway.identify import RequestIdentifier
from quillcache.gateway.outcomes import LatencySamples
from quillcache.gateway.tenancy import TenantPolicy, valid_tenant
from quillcache.gateway.workers import DiscoveryError, Worker, WorkerPool
from quillcache.tokenization.request import TokenizationError


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
    ) -> None:
        self.config = config
        self.plane = plane
        self.pool = pool
        self.ingestor = ingestor
        self.tenancy = tenancy
        self.identifier = identifier
        self.samples = samples
        self.on_worker_added = on_worker_added
        self.fleet = fleet  # shared state: the changes below go to the whole fleet

    async def workers(self, request: Request) -> Response:
        if request.method == "GET":
            return JSONResponse({"workers": [w.as_dict() for w in self.pool.workers.values()]})
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
        if self.fleet is not None and any(w.url == cfg.url for w in self.pool.workers.values()):
            raise ApiError(409, f"engine {cfg.url} is already a worker", "ConflictError")
        try:
            w = await self.pool.add(cfg)
        except DiscoveryError as exc:
            raise ApiError(400, str(exc)) from None
        self.on_worker_added(w)
        body = w.as_dict()
        if self.fleet is not None:
            body["shared"] = await self.fleet.engine_added(w)
        return JSONResponse(body, status_code=201)

    async def worker(self, request: Request) -> Response:
        if request.method == "DELETE":
            removed = self._worker_call(request, self.pool.remove)
            if self.fleet is not None:
                shared = await self.fleet.engine_removed(removed)
                return JSONResponse({"removed": removed.id, "shared": shared})
            return JSONResponse({"removed": removed.id})
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

    async def pins(self, request: Request) -> Response:
        keys = await self._keys_of(request)
        pin = request.method == "POST"
        if self.fleet is not None:
            tenant = request.headers.get(self.tenancy.tenant_header, "")
            if pin:
                out = await self.fleet.pin(keys, tenant, self.config.state_pin_ttl_s)
            else:
                out = await self.fleet.unpin(keys, tenant)
            if "owner" in out:
                raise ApiError(
                    409,
                    f"the prefix is pinned by another tenant ({out['owner']!r})",
                    "ConflictError",
                )
            return JSONResponse(out)
        if pin:
            self.plane.pin(keys)
        else:
            self.plane.unpin(keys)
        return JSONResponse({"pinned" if pin else "unpinned": len(keys)})

    # -- shared steps --------------------------------------------------------------------

    async def _body(self, request: Request, default: bytes = b"") -> dict[str, Any]:
        return await json_object(request, self.config.max_body_bytes, default)

    def _worker_call(self, request: Request, call: Any) -> Worker:
        """`call(worker_id)` with the id of the path; 404 for a bad or unknown id."""
        try:
            return call(int(request.path_params["worker_id"]))
        except (ValueError, UnknownWorkerError) as exc:
            raise ApiError(404, str(exc), "NotFoundError") from None

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
