"""The admin and debug API (`/admin/...`), behind the admin bearer token (`asgi.admin_only`).

Workers: list, add, get, remove, drain. Lookup: which worker holds how much of a prompt.
Index: stats, event sources, ingest counters and the gateway's own latency samples.
Pins: pin or unpin the blocks of a prompt.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from quillcache.controlplane import UnknownWorkerError
from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.httpio import ApiError, json_object, validate_completion
from quillcache.gateway.tenancy import valid_tenant
from quillcache.gateway.workers import DiscoveryError, Worker
from quillcache.tokenization.request import TokenizationError

if TYPE_CHECKING:
    from quillcache.gateway.app import Gateway


class AdminApi:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def workers(self, request: Request) -> Response:
        gw = self.gw
        if request.method == "GET":
            return JSONResponse({"workers": [w.as_dict() for w in gw.pool.workers.values()]})
        body = await self._body(request)
        try:
            cfg = WorkerConfig.model_validate(body)
        except ValueError as exc:
            raise ApiError(400, f"invalid worker: {exc}") from None
        try:
            w = await gw.pool.add(cfg)
        except DiscoveryError as exc:
            raise ApiError(400, str(exc)) from None
        gw.start_parity_check(w)
        return JSONResponse(w.as_dict(), status_code=201)

    async def worker(self, request: Request) -> Response:
        if request.method == "DELETE":
            removed = self._worker_call(request, self.gw.pool.remove)
            return JSONResponse({"removed": removed.id})
        return JSONResponse(self._worker_call(request, self.gw.pool.get).as_dict())

    async def drain(self, request: Request) -> Response:
        body = await self._body(request, default=b"{}")
        draining = body.get("draining", True)
        if not isinstance(draining, bool):
            raise ApiError(400, "'draining' must be true or false")
        worker = self._worker_call(request, self.gw.pool.get)
        self.gw.pool.set_draining(worker.id, draining)
        return JSONResponse(worker.as_dict())

    async def lookup(self, request: Request) -> Response:
        """Which worker holds how much of this prompt (body: a completion or chat body)."""
        gw = self.gw
        keys = await self._keys_of(request)
        matches = gw.cp.match(keys)
        bs = gw.cp.block_size
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
        gw = self.gw
        stats = gw.cp.index_stats()
        samples = {
            "route_latency_us": gw.route_samples,
            "pre_upstream_us": gw.pre_upstream_samples,
            "relay_chunk_us": gw.relay_samples,
        }
        response = JSONResponse(
            {
                "index": gw.config.index,
                "secret": gw.tenancy.secret.as_dict(),
                "tenants_isolated": gw.tenancy.isolating,
                "blocks": stats.blocks,
                "resident_pairs": stats.resident_pairs,
                "sources": stats.sources,
                "memory_bytes": stats.memory_bytes,
                "extra": stats.extra,
                "event_sources": [s.as_dict() for s in gw.ingestor.sources.values()],
                "ingest": vars(gw.ingestor.stats()),
                **{name: percentiles_us(values) for name, values in samples.items()},
            }
        )
        if request.query_params.get("reset_latency"):
            for values in samples.values():
                values.clear()
        return response

    async def pins(self, request: Request) -> Response:
        gw = self.gw
        keys = await self._keys_of(request)
        pin = request.method == "POST"
        if pin:
            gw.cp.pin(keys)
        else:
            gw.cp.unpin(keys)
        return JSONResponse({"pinned" if pin else "unpinned": len(keys)})

    # -- shared steps --------------------------------------------------------------------

    async def _body(self, request: Request, default: bytes = b"") -> dict[str, Any]:
        return await json_object(request, self.gw.config.max_body_bytes, default)

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
        tenancy = self.gw.tenancy
        tenant = request.headers.get(tenancy.tenant_header, "")
        if tenant and not valid_tenant(tenant):
            raise ApiError(400, f"the {tenancy.tenant_header} header is not a valid tenant")
        identity = tenancy.identity(tenant, body.get("cache_salt"))
        try:
            route_request, _ = await self.gw.identify(body, chat, {}, identity)
        except (TokenizationError, ValueError, TypeError) as exc:
            raise ApiError(400, f"cannot tokenize: {exc}") from None
        return route_request.content_keys


def percentiles_us(samples: collections.deque[float]) -> dict[str, float]:
    if not samples:
        return {}
    values = np.fromiter(samples, dtype=np.float64) * 1e6
    p50, p90, p99 = np.percentile(values, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "n": float(len(values))}
