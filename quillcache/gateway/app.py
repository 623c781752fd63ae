"""The gateway: its parts, their lifecycle and the ASGI app.

Request path (`openai_api`): parse -> tokens (local or engine /tokenize) -> namespace ->
content keys (`identify`) -> `ControlPlane.route` -> forward (retry once elsewhere on a
failed connect) -> stream back; what becomes of it is booked by `outcomes`. Event path
(other thread): ZMQ (`connectors`) or HTTP (`ingest_http`) -> bounded queue -> index.
Admin API: `admin`; parity check: `parity`. This module builds those parts and hands
each the few collaborators it needs; none of them reaches back through the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from quillcache.connectors import EventIngestor
from quillcache.connectors.sink import ControlPlaneSink
from quillcache.controlplane import ControlPlane
from quillcache.errors import ConfigError, QuillCacheError, UnknownRouterError
from quillcache.gateway import asgi
from quillcache.gateway.actuator import Warmer
from quillcache.gateway.admin import AdminApi
from quillcache.gateway.bootstrap import (
    Bootstrapper,
    BootstrapReport,
    Expectations,
    local_sources,
    peers_to_try,
)
from quillcache.gateway.config import GatewayConfig, WorkerConfig
from quillcache.gateway.fleet import AdoptedPin, FleetLink, KeptPin
from quillcache.gateway.identify import RequestIdentifier
from quillcache.gateway.ingest_http import IngestEndpoint
from quillcache.gateway.lmcache_ctl import LmcacheController
from quillcache.gateway.metrics import (
    GatewayMetrics,
    bootstrap_metrics,
    fold_metrics,
    multimodal_metrics,
    readiness_metrics,
    split_metrics,
    state_metrics,
)
from quillcache.gateway.openai_api import CHAT_COMPLETIONS, COMPLETIONS, OpenAIEndpoints
from quillcache.gateway.outcomes import RequestOutcomes
from quillcache.gateway.parity import ParityChecker
from quillcache.gateway.peers import PeerDirectory
from quillcache.gateway.pending import FIRST_RETRY_S, PendingEngine, PendingEngines
from quillcache.gateway.policy_loop import PolicyEngine
from quillcache.gateway.readiness import Readiness, readiness
from quillcache.gateway.secret import load_or_create
from quillcache.gateway.tenancy import TenantPolicy
from quillcache.gateway.workers import DiscoveryError, EventSourceError, Worker, WorkerPool
from quillcache.identity import content_keys
from quillcache.policy.budget import ActuationBudget
from quillcache.policy.targets import KeyArray, Target, TargetBudgetError, TargetKind
from quillcache.routing import Router
from quillcache.routing.registry import create_router, import_router
from quillcache.state import PinRecord
from quillcache.state.warm_claims import WarmClaims
from quillcache.tokenization.multimodal import MultimodalPrompts
from quillcache.tokenization.request import RequestTokenizer

log = logging.getLogger(__name__)

DESCRIBE_AT_ONCE = 64  # engines described concurrently at start-up

# What the native relay adds to a request it passes to this app: the client's address,
# and a per-process key that tells it came from the relay (any local process could
# connect to the app's loopback port and claim an address).
PEER_HEADER = "x-quillcache-peer"
PEER_KEY_HEADER = "x-quillcache-relay-key"


def resolve_router(spec: str, options: dict[str, Any]) -> Router | str:
    """A registered router name, or "pkg.module:Class" for a user's router class."""
    if ":" not in spec:
        return spec
    try:
        import_router(spec)
        # through create_router, as a registered name: the options every router takes
        # (ttft_slo_s, tbt_slo_s) work for a user's router too
        router = create_router(spec, **options)
    except UnknownRouterError as exc:
        raise ConfigError(str(exc)) from None
    except TypeError as exc:
        raise ConfigError(f"router {spec!r}: bad router_options: {exc}") from exc
    if not callable(getattr(router, "route", None)):
        raise ConfigError(f"router {spec!r} has no route(request, view) method")
    return router


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
        self.tenancy: TenantPolicy
        self.relay_key = secrets.token_hex(16)
        # the parts that serve requests, built by `startup`
        self.identifier: RequestIdentifier
        self.outcomes: RequestOutcomes
        self.openai: OpenAIEndpoints
        self.admin: AdminApi
        self.ingest: IngestEndpoint
        self.parity: ParityChecker
        self.policy: PolicyEngine
        self._tasks: list[asyncio.Task[Any]] = []
        # `state: redis://...`: this replica's link to the fleet's shared state
        self.fleet: FleetLink | None = None
        # `state: redis://...`: where ready replicas advertise their snapshot endpoint
        self.peers: PeerDirectory | None = None
        self.bootstrap = BootstrapReport()
        # configured engines not described yet (down at start, a KV port held): retried
        self.pending = PendingEngines()
        self.started = False
        self.startup_error: QuillCacheError | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def startup(self) -> None:
        cfg = self.config
        secret = load_or_create(Path(cfg.secret_file) if cfg.secret_file else None)
        self.tenancy = TenantPolicy(
            secret,
            key_tenants={k.digest: k.tenant for k in cfg.api_keys},
            trusted_proxies=cfg.trusted_proxies,
            tenant_header=cfg.tenant_header,
        )
        notice = self.tenancy.startup_notice()
        if notice:
            log.warning("gateway: %s", notice)
        log.info("gateway secret fingerprint %s", secret.fingerprint)
        if cfg.state != "local":
            # first: a replica of the wrong fleet (another secret) refuses before anything
            self.fleet = FleetLink(cfg, self.metrics)
            await self.fleet.start(secret)
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
        found = await self._describe_all(cfg.workers)
        described = [w for w in found if isinstance(w, Worker)]
        sizes = {w.block_size for w in described if w.block_size is not None}
        if cfg.block_size is not None:
            sizes.add(cfg.block_size)
        if len(sizes) > 1:
            raise ConfigError(f"engines disagree on the block size: {sorted(sizes)}")
        missed = {i: why for i, why in enumerate(found) if isinstance(why, str)}
        if missed and not sizes:
            whys = "; ".join(f"{cfg.workers[i].url}: {why}" for i, why in missed.items())
            raise ConfigError(
                f"no engine gave its block size ({whys}): set block_size in the config to "
                "start the gateway before its engines"
            )
        block_size = cfg.block_size or (sizes.pop() if sizes else 16)
        if cfg.state != "local":
            self.peers = PeerDirectory(cfg.state, cfg.state_prefix, cfg.state_lease_ttl_s)
        # a peer's index image, before any subscription (bootstrap.py)
        loaded = await Bootstrapper(
            token=cfg.bootstrap_token or cfg.admin_token,
            timeout_s=cfg.bootstrap_timeout_s,
            max_bytes=cfg.bootstrap_max_bytes,
            replay_timeout_s=cfg.replay_timeout_s,
        ).run(
            await peers_to_try(cfg, self.peers, self.advertise_url()),
            Expectations(
                secret_fingerprints=secret.accepted_fingerprints(),
                block_size=block_size,
                tokenizer_id=cfg.tokenizer_id,
                sources=local_sources(described),
            ),
        )
        self.bootstrap = loaded.report
        router = resolve_router(cfg.router, cfg.router_options)
        self.router_name = router if isinstance(router, str) else type(router).__name__
        self.cp = ControlPlane(
            index=loaded.index if loaded.index is not None else cfg.index,
            router=router,
            block_size=block_size,
            track_load=True,
            speculative=True,
            speculative_ttl_s=cfg.speculative_ttl_s,
            router_options=cfg.router_options if isinstance(router, str) else None,
            index_options=cfg.index_options,
            load_store=self.fleet.store if self.fleet is not None else None,
            # the booking in Redis says where a request goes (`openai_api.route_booked`)
            speculate_when_booked=self.fleet is not None,
        )
        # ingest runs on the ingestor's thread: the plane serialises index access itself
        self.sink = ControlPlaneSink(self.cp)
        self.ingestor = EventIngestor(
            self.sink,
            queue_size=cfg.event_queue_size,
            queue_bytes=cfg.event_queue_bytes,
            replay_timeout_s=cfg.replay_timeout_s,
            stale_rebuild_s=cfg.stale_rebuild_s,
            quiet_tail_s=cfg.event_quiet_tail_s,
        )
        self.pool = WorkerPool(self.cp, self.ingestor, self.client, tokenizer_id=cfg.tokenizer_id)
        self.pool.failures_to_down = cfg.health_failures_to_down
        self.pool.kv_publishers = cfg.kv_publishers
        self.pool.resume_seqs = self.sink.last_seqs()
        if self.pool.resume_seqs:
            log.info("persistent index: resuming sources at %s", self.pool.resume_seqs)
        for key, (seq, digest) in loaded.resume.items():  # replay from the image's seqs
            self.pool.resume_seqs[key] = seq
            self.ingestor.resume_digests[key] = (seq, digest)
        fleet = self.fleet
        routing = None
        if fleet is not None:
            routing = fleet.bind(self.cp, self.pool, self.start_parity_check)
        self.pool.reserve(len(cfg.workers))
        for i, w in enumerate(found):
            if isinstance(w, str):
                self.pending.add(i, cfg.workers[i], w)
                continue
            try:
                self.pool.attach(w, i)
            except EventSourceError as exc:  # its KV port still held: retried
                self.pending.add(i, cfg.workers[i], str(exc))
                continue
            if fleet is not None:
                fleet.attached(w)
        self.tokenizer = RequestTokenizer(
            cfg.tokenizer, self.upstream, timeout_s=cfg.first_byte_timeout_s
        )
        self._build_parts()
        self.metrics.add_collector(self._collect)
        self.metrics.add_collector(self.policy.collect)
        if fleet is not None:
            self.openai.shared = self.outcomes.shared = routing
            self.metrics.add_collector(fleet.collect)
            fleet.on_pin(self._keep_fleet_pin)
            fleet.pins_from(self._kept_pins)
            # what the fleet changed through the admin API before this replica started
            await fleet.poll_once()
            fleet.begin()
        self._tasks = [
            asyncio.create_task(self._every(cfg.health_interval_s, self.pool.check_health)),
            asyncio.create_task(self._every(cfg.scrape_interval_s, self.pool.scrape)),
            asyncio.create_task(self._every(cfg.policy.interval_s, self.policy.tick)),
            asyncio.create_task(self._every(FIRST_RETRY_S / 2, self._join_pending)),
        ]
        for w in list(self.pool.workers.values()):
            self.start_parity_check(w)
        self.started = True

    async def _join_pending(self) -> None:
        if not self.pending.engines:
            return
        async with self._describe_client() as client:
            await self.pending.retry_due(lambda p: self._join(client, p), DESCRIBE_AT_ONCE)

    async def _join(self, client: httpx.AsyncClient, p: PendingEngine) -> Worker | None:
        """A pending engine described and attached under its reserved id, as the admin
        API adds one (`pending.py`); None when it is no longer to join: removed through
        the admin API while it was being described, or its URL added meanwhile as
        another worker (the admin API, the fleet)."""
        w = await WorkerPool.describe(client, p.config)
        if self.pending.engines.get(p.worker_id) is not p:
            return None
        same = self.pool.by_url(w.url)
        if same is not None:
            log.warning(
                "engine %s (worker %d) was added meanwhile as worker %d: not joined twice",
                w.url,
                p.worker_id,
                same.id,
            )
            return None
        self.pool.check_block_size(w)
        self.pool.attach(w, p.worker_id)
        if self.fleet is not None:
            self.fleet.attached(w)
        self.start_parity_check(w)
        return w

    def _describe_client(self) -> httpx.AsyncClient:
        """A client for describing engines (start-up, pending engines): connections not
        kept, `DESCRIBE_AT_ONCE` at a time (`_describe_all` says why)."""
        cfg = self.config
        return httpx.AsyncClient(
            timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
            limits=httpx.Limits(max_connections=DESCRIBE_AT_ONCE, max_keepalive_connections=0),
        )

    async def _describe_all(self, workers: list[WorkerConfig]) -> list[Worker | str]:
        """Every configured engine described, at most `DESCRIBE_AT_ONCE` at a time, on
        connections that are not kept: httpx scans its whole pool on every request, so
        1,024 engines described at once through one pool took O(engines²) (tens of
        seconds, and engines' keep-alive timeouts closed connections under it: their
        event sources were missed). An engine that cannot be described is why not, a
        string (`pending.py`)."""
        gate = asyncio.Semaphore(DESCRIBE_AT_ONCE)
        async with self._describe_client() as client:

            async def one(w: WorkerConfig) -> Worker | str:
                async with gate:
                    try:
                        return await WorkerPool.describe(client, w)
                    except DiscoveryError as exc:
                        return str(exc)

            return list(await asyncio.gather(*(one(w) for w in workers)))

    async def shutdown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if hasattr(self, "policy"):
            await self.policy.close()
        if hasattr(self, "pool"):
            self.pool.close()
        if hasattr(self, "ingestor"):
            self.ingestor.close()
        if hasattr(self, "client"):
            await self.client.aclose()
        if hasattr(self, "upstream"):
            await self.upstream.close()
        if self.peers is not None:
            await self.peers.close()  # withdrawn: no joiner asks a stopped replica
            self.peers = None
        if self.fleet is not None:
            await self.fleet.close()  # leave: this replica's share goes now
            self.fleet = None
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

    def _keep_fleet_pin(self, pin: AdoptedPin) -> None:
        """A pin made through another replica: this replica's policy engine keeps it
        warm too (the fleet's warm claims let one warm request through), so that it
        outlives the replica it was made through, and counts it against its owner's
        pin budget as that replica did."""
        target = Target(
            kind=TargetKind.PIN,
            tenant=pin.owner,
            name=str(pin.prefix_key),
            keys=pin.keys,
            token_ids=pin.record.tokens,
            model=pin.record.model,
            salt=pin.record.salt,
            expires_s=time.monotonic() + pin.ttl_left_s,
        )
        if self.policy.store.get(target.id) is not None:
            return
        try:
            self.policy.retain(target)
        except TargetBudgetError as exc:
            log.warning("shared state: a fleet pin is not kept warm here: %s", exc)

    def _kept_pins(self) -> list[KeptPin]:
        """The pins the policy engine keeps, for the fleet to put back in Redis."""
        now = time.monotonic()
        return [
            (t.keys, t.tenant, t.expires_s - now, PinRecord(t.model, t.salt, t.token_ids))
            for t in self.policy.store
            if t.kind is TargetKind.PIN and t.expires_s > now
        ]

    async def _every(self, interval_s: float, job: Any) -> None:
        name = getattr(job, "__name__", str(job))
        failures = self.metrics.background_failures.labels(name)  # exported from 0
        while True:
            try:
                await job()
            except Exception:
                failures.inc()
                log.exception("gateway background job %s failed", name)
            await asyncio.sleep(interval_s)

    def _build_parts(self) -> None:
        cfg, cp, pool = self.config, self.cp, self.pool
        self.identifier = RequestIdentifier(
            pool=pool,
            tokenizer=self.tokenizer,
            block_size=cp.block_size,
            tokenizer_id=cfg.tokenizer_id,
            session_header=cfg.session_header,
            on_tokenize_retry=lambda worker_id: self.outcomes.tokenize_retry(worker_id),
            multimodal=MultimodalPrompts(cfg.multimodal),
        )
        self.outcomes = RequestOutcomes(
            plane=cp,
            ingestor=self.ingestor,
            pool=pool,
            metrics=self.metrics,
            router_name=self.router_name,
        )
        policy = cfg.policy
        self.policy = PolicyEngine(
            policy,
            plane=cp,
            pool=pool,
            warmer=Warmer(
                self.upstream,
                ActuationBudget(
                    engine_rate=policy.engine_tokens_per_s,
                    tenant_rate=policy.tenant_tokens_per_s,
                    burst_s=policy.budget_burst_s,
                ),
                block_size=cp.block_size,
                timeout_s=policy.timeout_s,
                max_concurrent=policy.max_concurrent,
                # with shared state: one in-flight marker and budget for the fleet
                claims=(
                    WarmClaims(cfg.state, prefix=cfg.state_prefix)
                    if self.fleet is not None
                    else None
                ),
                linger_s=policy.touch_min_interval_s,
            ),
            pins_in_plane=self.fleet is None,
        )
        cp.pinned.max_wait_s = policy.holder_max_wait_s
        if policy.lmcache is not None:
            identifier, block_size = self.identifier, cp.block_size

            def offload_keys(model: str, tokens: list[int]) -> KeyArray:
                # LMCache's chunks as the index keys them: in-process LMCache keys chunks
                # by tokens alone and its events name no salt (docs/policy.md)
                return content_keys(tokens, block_size, identifier.namespace_of(model, ""))

            self.policy.attach_lmcache(
                LmcacheController(self.upstream, policy.lmcache), offload_keys
            )
        self.openai = OpenAIEndpoints(
            config=cfg,
            plane=cp,
            pool=pool,
            tenancy=self.tenancy,
            identifier=self.identifier,
            outcomes=self.outcomes,
            upstream=self.upstream,
            peer_of=self.peer_of,
            policy=self.policy,
        )
        self.parity = ParityChecker(
            identifier=self.identifier,
            tokenizer=self.tokenizer,
            client=self.client,
            plane=cp,
            ingestor=self.ingestor,
        )
        self.admin = AdminApi(
            pending=self.pending,
            config=cfg,
            plane=cp,
            pool=pool,
            ingestor=self.ingestor,
            tenancy=self.tenancy,
            identifier=self.identifier,
            samples=self.outcomes.samples,
            on_worker_added=self.start_parity_check,
            fleet=self.fleet,
            ready=lambda: self.readiness().ready,
            metrics=self.metrics,
            decisions=self.outcomes.decisions,
            policy=self.policy,
            upstream=self.upstream,
        )
        self.ingest = IngestEndpoint(
            ingestor=self.ingestor,
            dp_ranks_of=lambda w: cp.worker(w).dp_ranks if w in pool.workers else None,
            known_workers=lambda: list(pool.workers),
            max_body_bytes=cfg.max_body_bytes,
        )

    def peer_of(self, request: Request) -> str | None:
        """The client's address. Behind the native relay the app's peer is the relay:
        the relay names the client in a header, believed only with the relay's key."""
        key = request.headers.get(PEER_KEY_HEADER)
        if key is not None and hmac.compare_digest(key, self.relay_key):
            return request.headers.get(PEER_HEADER)
        return request.client.host if request.client else None

    # -- small endpoints and checks ------------------------------------------------------

    def advertise_url(self, port: int | None = None) -> str | None:
        """The URL peers reach this replica at: `advertise_url`, else http://host:port
        when the host is one address (not a wildcard) and the port is known."""
        if self.config.advertise_url:
            return self.config.advertise_url.rstrip("/")
        host, port = self.config.host, port or self.config.port
        if host in ("", "0.0.0.0", "::") or not port:
            return None
        return f"http://{'[' + host + ']' if ':' in host else host}:{port}"

    def listening(self, port: int) -> None:
        """The gateway serves on `port`: advertise it to joining peers while ready."""
        if self.peers is None:
            return
        url = self.advertise_url(port)
        if url is None:
            log.warning(
                "peers: listening on %s; not advertised for peer snapshots (set advertise_url)",
                self.config.host,
            )
            return
        self.peers.start(url, lambda: self.readiness().ready)

    def start_parity_check(self, w: Worker) -> None:
        if self.config.parity_check:
            self._tasks.append(asyncio.create_task(self.parity.check(w)))

    async def health(self, request: Request) -> Response:
        """Liveness: the process serves (`readiness.py`), whatever the engines do."""
        return JSONResponse({"status": "ok"})

    def readiness(self) -> Readiness:
        state = readiness(self.pool.workers.values(), self.ingestor.sources)
        state.bootstrap = self.bootstrap
        state.pending = self.pending.as_list()
        return state

    async def ready(self, request: Request) -> Response:
        """Readiness: a routable engine, and every routable engine's event sources caught
        up; 503 saying what is missing otherwise (`readiness.py`)."""
        state = self.readiness()
        return JSONResponse(state.as_dict(), status_code=200 if state.ready else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _collect(self) -> Iterator[Any]:
        index_stats = self.cp.index_stats()
        yield from state_metrics(
            self.ingestor.stats(),
            index_stats,
            list(self.pool.workers.values()),
            lambda worker_id: float(self.cp.worker(worker_id).in_flight),
        )
        yield from readiness_metrics(self.readiness())
        yield from bootstrap_metrics(self.bootstrap)
        yield from fold_metrics(self.sink.fold_stats())
        yield from split_metrics(self.sink.split_stats())
        yield from multimodal_metrics(self.identifier.multimodal.stats)

    # -- assembly ------------------------------------------------------------------------

    def starlette(self, *, with_lifespan: bool = True) -> ASGIApp:
        """The ASGI app; without lifespan the caller runs `startup`/`shutdown` itself.
        The routes are bound before startup builds the parts that answer them."""

        def admin_only(handler: asgi.Handler) -> asgi.Handler:
            return asgi.admin_only(handler, lambda: self.config.admin_token)

        async def completions(request: Request) -> Response:
            return await self.openai.completions(request)

        async def chat_completions(request: Request) -> Response:
            return await self.openai.chat_completions(request)

        def admin(name: str) -> asgi.Handler:
            async def handler(request: Request) -> Response:
                answer: Response = await getattr(self.admin, name)(request)
                return answer

            return admin_only(handler)

        async def models(request: Request) -> Response:
            return await self.openai.models(request)

        async def ingest(request: Request) -> Response:
            return await self.ingest(request)

        routes = [
            Route(COMPLETIONS, completions, methods=["POST"]),
            Route(CHAT_COMPLETIONS, chat_completions, methods=["POST"]),
            Route("/v1/models", asgi.api_errors(models), methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/admin/workers", admin("workers"), methods=["GET", "POST"]),
            Route("/admin/workers/{worker_id}", admin("worker"), methods=["GET", "DELETE"]),
            Route("/admin/workers/{worker_id}/drain", admin("drain"), methods=["POST"]),
            Route("/admin/lookup", admin("lookup"), methods=["POST"]),
            Route("/admin/index", admin("index"), methods=["GET"]),
            Route("/admin/pins", admin("pins"), methods=["GET", "POST", "DELETE"]),
            Route("/admin/sessions", admin("sessions"), methods=["GET"]),
            Route(
                "/admin/workers/{worker_id}/reset_prefix_cache",
                admin("reset_prefix_cache"),
                methods=["POST"],
            ),
            Route("/admin/snapshot", admin("snapshot"), methods=["GET"]),
            Route("/admin/decisions", admin("decisions_log"), methods=["GET"]),
            Route("/ingest/kv_events", admin_only(ingest), methods=["POST"]),
        ]
        app = Starlette(routes=routes, lifespan=self.lifespan if with_lifespan else None)
        app.add_exception_handler(404, asgi.not_found)
        app.add_exception_handler(405, asgi.not_allowed)
        app.add_exception_handler(Exception, asgi.internal_error)
        hot = {COMPLETIONS: completions, CHAT_COMPLETIONS: chat_completions}
        return asgi.HotPath(app, hot)
