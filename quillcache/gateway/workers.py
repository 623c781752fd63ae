"""The engines behind the gateway: discovery, lifecycle, health and load.

Each engine is a worker of the `ControlPlane`. Adding one asks the engine what it
serves (`/v1/models`), where it publishes KV events (`/kv_event_sources`) and its
block size, then subscribes to its events. A worker is routable when it is healthy
and not draining; a worker that fails its health check (or a connect) gets no traffic
and its residency is dropped: its cache will be relearned from its events.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from dataclasses import asdict, dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from quillcache.connectors import EventIngestor, ZmqSourceConfig
from quillcache.connectors.engine_metrics import EngineLoad, parse_engine_metrics
from quillcache.connectors.zmq_source import engine_binds, with_rank
from quillcache.controlplane import ControlPlane
from quillcache.errors import ConfigError
from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.engine_hashes import HashVerdict
from quillcache.gateway.probe import EngineProbe, Result, fetch_all, parse_metrics_fast

log = logging.getLogger(__name__)


@dataclass
class Worker:
    id: int
    config: WorkerConfig
    base_model: str = ""
    # the base model's `root` in /v1/models: vLLM's --model (a path or hub id), which
    # vLLM hashes images with; differs from base_model under --served-model-name
    model_root: str = ""
    models: dict[str, str] = field(default_factory=dict)  # served name -> LoRA ("" = base)
    block_size: int | None = None
    max_model_len: int | None = None  # from /v1/models (vLLM reports it)
    # its sequence slots as the engine says (SGLang's `max_running_requests`)
    max_num_seqs: int | None = None
    healthy: bool = True
    draining: bool = False
    load: EngineLoad = field(default_factory=EngineLoad)
    last_health_s: float = 0.0
    failures: int = 0
    parity: str = "unchecked"  # "ok", "mismatch: ...", "unchecked", "skipped: ..."
    # the engine-hash half of the parity check (`engine_hashes.py`)
    hash_parity: HashVerdict = field(default_factory=lambda: HashVerdict("unchecked"))
    # per rank (None: the whole engine), what the last scrape added on top of the
    # gateway's own counts (in flight, decodes) and the KV usage it gave the plane
    # (`_merge_engine_load`)
    scraped: dict[int | None, tuple[int, int, float | None]] = field(default_factory=dict)
    sources: list[ZmqSourceConfig] = field(default_factory=list)
    # the last /metrics page read: a scrape that changes nothing costs no parse
    last_metrics_page: bytes = b""

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "url": self.url,
            "base_model": self.base_model,
            "models": sorted(self.models),
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            # its sequence slots per rank: configured, else the engine's own (SGLang),
            # else None (the cost model's engine.max_num_seqs)
            "max_num_seqs": self.config.max_num_seqs or self.max_num_seqs,
            "healthy": self.healthy,
            "draining": self.draining,
            "parity": self.parity,
            "hash_parity": str(self.hash_parity),
            "engine_hashes": self.hash_parity.as_dict(),
            "load": asdict(self.load),
            "kv_sources": [
                {"endpoint": s.endpoint, "replay_endpoint": s.replay_endpoint, "bind": s.bind}
                for s in self.sources
            ],
        }


#: Waits before each retry of an engine's event-source description (`_describe_json`).
DESCRIBE_RETRY_S = (0.2, 0.5, 1.0)


async def _describe_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    """A JSON description an engine may or may not offer: None when it does not (a 4xx,
    or not a JSON object). A failure that says nothing about the engine's endpoints (no
    connection, a 5xx) is retried, then a `DiscoveryError`: taken for "not offered", it
    would leave the engine routed without its KV events for good."""
    why = ""
    for wait_s in (*DESCRIBE_RETRY_S, None):
        try:
            resp = await client.get(url)
        except httpx.HTTPError as exc:
            why = f"{type(exc).__name__}: {exc}"
        else:
            if resp.status_code < 500:
                if resp.status_code != 200:
                    return None
                try:
                    data = resp.json()
                except ValueError:
                    return None
                return data if isinstance(data, dict) else None
            why = f"HTTP {resp.status_code}"
        if wait_s is not None:
            await asyncio.sleep(wait_s)
    raise DiscoveryError(f"{url}: {why} ({len(DESCRIBE_RETRY_S) + 1} attempts)")


async def _get_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    try:
        resp = await client.get(url)
        data = resp.json() if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _reachable(endpoint: str, host: str) -> str:
    """A bound wildcard address (`tcp://*:5557`) as a peer on `host` connects to it."""
    return endpoint.replace("*", host).replace("0.0.0.0", host)


def sources_from_kv_event_sources(info: dict[str, Any], host: str) -> list[ZmqSourceConfig]:
    """vLLM's `GET /kv_event_sources` (as the engine simulator serves it): one entry per
    rank with its resolved `endpoint`, `replay_endpoint`, `topic` and `engine_binds`."""
    out = []
    for src in info.get("sources", []):
        replay = src.get("replay_endpoint")
        out.append(
            ZmqSourceConfig(
                worker=-1,
                endpoint=_reachable(src["endpoint"], host),
                replay_endpoint=_reachable(replay, host) if replay else None,
                dp_rank=int(src.get("dp_rank", 0)),
                topic=src.get("topic", "") or "",
                bind=not src.get("engine_binds", True),
            )
        )
    return out


def sources_from_server_info(info: dict[str, Any], host: str) -> list[ZmqSourceConfig]:
    """SGLang's `GET /get_server_info`: its server args, among them `kv_events_config`
    (vLLM's JSON shape, as a string or an object) and `dp_size`; rank r at port + r."""
    raw = info.get("kv_events_config")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return []
    if not isinstance(raw, dict) or raw.get("publisher", "zmq") != "zmq":
        return []
    endpoint = raw.get("endpoint", "tcp://*:5557")
    replay = raw.get("replay_endpoint")
    binds = engine_binds(endpoint)
    out = []
    for rank in range(int(info.get("dp_size") or 1)):
        ep = with_rank(endpoint, rank)
        out.append(
            ZmqSourceConfig(
                worker=-1,
                endpoint=_reachable(ep, host) if binds else ep,
                replay_endpoint=_reachable(with_rank(replay, rank), host) if replay else None,
                dp_rank=rank,
                topic=raw.get("topic", "") or "",
                bind=not binds,
            )
        )
    return out


async def sglang_server_info(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    """SGLang's server arguments: `GET /server_info` (current), else `/get_server_info`
    (older releases). A prefill/decode deployment nests them per role: take the first
    entry of a role that has `kv_events_config`."""
    for path in ("/server_info", "/get_server_info"):
        info = await _get_json(client, url + path)
        if info is not None:
            return server_args_of(info)
    return {}


def server_args_of(info: dict[str, Any]) -> dict[str, Any]:
    """The server arguments in an SGLang server-info answer, flat or nested per role."""
    if "kv_events_config" in info:
        return info
    for role in ("prefill", "decode"):  # prefix reuse happens where prompts are computed
        nested = info.get(role)
        if isinstance(nested, list) and nested and isinstance(nested[0], dict):
            return nested[0]
    return info


#: A header the gateway's own `/v1/models` answers with: describing a URL that answers
#: with it is refused (a gateway is not an engine).
GATEWAY_HEADER = "x-quillcache-gateway"


class DiscoveryError(ConfigError):
    """An engine could not be reached or described itself in a way we cannot use."""


class DuplicateWorkerError(ConfigError):
    """An engine added again while its URL is already a worker's: nothing was added."""


class EventSourceError(ConfigError):
    """An engine's KV-event source could not be opened (its endpoint cannot be bound or
    connected, e.g. a port the previous socket still holds): nothing of the engine was
    added, and adding it again may succeed once the endpoint is free."""


class WorkerPool:
    def __init__(
        self,
        cp: ControlPlane,
        ingestor: EventIngestor,
        client: httpx.AsyncClient,
        *,
        tokenizer_id: str = "",
        kv_publishers: list[str] | None = None,
    ) -> None:
        self.cp = cp
        self.ingestor = ingestor
        self.client = client
        self.tokenizer_id = tokenizer_id
        # who may connect to a source the gateway binds; None: the engine's own address
        self.kv_publishers = kv_publishers
        self.workers: dict[int, Worker] = {}
        self._next_id = 0
        self._models: dict[str, str] | None = None  # cache of models(), reset on changes
        self._serving: dict[str, frozenset[int] | None] = {}  # cache of serving()
        # cache of context_limit(): asked on every request, a loop over the whole fleet
        self._limits: dict[frozenset[int] | None, int | None] = {}
        # last engine seq per (worker, dp_rank) kept by a persistent index: resume there
        self.resume_seqs: dict[tuple[int, int], int] = {}
        self.failures_to_down = 2  # consecutive failed health checks before "down"
        # one kept-alive connection per engine for the health checks and scrapes
        # (`probe.py`); None for an engine the probe cannot speak to (https): httpx
        self._probes: dict[int, EngineProbe | None] = {}

    # -- discovery -----------------------------------------------------------------------

    @staticmethod
    async def describe(client: httpx.AsyncClient, cfg: WorkerConfig) -> Worker:
        """Ask an engine what it serves and where its events are (no side effects)."""
        w = Worker(id=-1, config=cfg)
        try:
            listed = await client.get(f"{cfg.url}/v1/models")
            gateway = GATEWAY_HEADER in listed.headers
            models = None if gateway else listed.json()["data"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            hint = ""
            if cfg.url.rstrip("/").endswith("/v1"):
                hint = " (give the engine's base URL, without /v1: the gateway adds it)"
            raise DiscoveryError(f"engine {cfg.url}: cannot list /v1/models: {exc}{hint}") from exc
        if models is None:
            raise DiscoveryError(
                f"{cfg.url} is a QuillCache gateway, not an engine: its requests would come "
                "back through a gateway (itself: a loop); give the engine's own URL"
            )
        for m in models:
            parent = m.get("parent")
            w.models[m["id"]] = m["id"] if parent else ""
            if not parent and not w.base_model:
                w.base_model = m["id"]
                w.model_root = str(m.get("root") or m["id"])
        if not w.base_model and models:
            w.base_model = models[0].get("root") or models[0]["id"]
            w.model_root = w.base_model
        lengths = [m.get("max_model_len") for m in models]
        if lengths and all(isinstance(n, int) and n > 0 for n in lengths):
            w.max_model_len = max(lengths)
        try:
            w.load = parse_engine_metrics((await client.get(f"{cfg.url}/metrics")).text)
            w.block_size = w.load.block_size
        except (httpx.HTTPError, ValueError) as exc:
            log.warning(
                "engine %s: /metrics unreadable (%s); load from in-flight only", cfg.url, exc
            )
        if cfg.events and cfg.kv_endpoint is None:
            host = urlsplit(cfg.url).hostname or "127.0.0.1"
            info = await _describe_json(client, f"{cfg.url}/kv_event_sources")
            if info is not None:
                w.block_size = info.get("block_size") or w.block_size
                w.sources = sources_from_kv_event_sources(info, host)
            else:  # SGLang: its server args, kv_events_config included
                info = await sglang_server_info(client, cfg.url)
                w.sources = sources_from_server_info(info, host)
                page_size = info.get("page_size")
                w.block_size = w.block_size or (page_size if isinstance(page_size, int) else None)
                running = info.get("max_running_requests")
                if isinstance(running, int) and not isinstance(running, bool) and running > 0:
                    w.max_num_seqs = running
            if not w.sources:
                log.warning(
                    "engine %s: no KV event source found; routing without its cache", cfg.url
                )
        elif cfg.events and cfg.kv_endpoint is not None:
            for rank in range(cfg.dp_ranks):
                replay = cfg.replay_endpoint
                w.sources.append(
                    ZmqSourceConfig(
                        worker=-1,
                        endpoint=with_rank(cfg.kv_endpoint, rank),
                        replay_endpoint=with_rank(replay, rank) if replay else None,
                        dp_rank=rank,
                        topic=cfg.topic,
                        bind=cfg.kv_bind,
                    )
                )
        return w

    async def add(self, cfg: WorkerConfig) -> Worker:
        """Describe and attach an engine; `DuplicateWorkerError` when its URL is already a
        worker's, or names the same address (`localhost` and `127.0.0.1`): checked
        again after the description, since it may have joined meanwhile."""
        self._check_new(cfg.url)
        await self._check_same_address(cfg.url)
        w = await self.describe(self.client, cfg)
        self._check_new(cfg.url)
        self.check_block_size(w)
        return self.attach(w)

    async def _check_same_address(self, url: str) -> None:
        """`DuplicateWorkerError` when `url` reaches a worker's engine under another
        spelling: the same scheme, port and path at an address both names resolve to
        (one engine served as two workers would split its traffic and its cache)."""
        mine = await _addresses(url)
        if not mine:
            return
        for w in list(self.workers.values()):
            if mine & await _addresses(w.url):
                raise DuplicateWorkerError(
                    f"engine {url} is already worker {w.id} ({w.url}: the same address)"
                )

    def _check_new(self, url: str) -> None:
        same = self.by_url(url)
        if same is not None:
            raise DuplicateWorkerError(f"engine {url} is already worker {same.id}")

    def by_url(self, url: str) -> Worker | None:
        return next((w for w in self.workers.values() if w.url == url), None)

    def check_block_size(self, w: Worker) -> None:
        """`DiscoveryError` when a described engine hashes blocks of another size."""
        if w.block_size is not None and w.block_size != self.cp.block_size:
            raise DiscoveryError(
                f"engine {w.url} uses block size {w.block_size}, the gateway {self.cp.block_size}"
            )

    def reserve(self, ids: int) -> None:
        """Worker ids below `ids` are given only when asked for by number (`attach`):
        the places of the configured engines, some of which join later."""
        self._next_id = max(self._next_id, ids)

    def attach(self, w: Worker, worker_id: int | None = None) -> Worker:
        """Register a described engine with the control plane and subscribe to its events,
        as `worker_id` (a reserved id) or the next free one."""
        if worker_id is not None and worker_id in self.workers:
            raise ConfigError(f"worker id {worker_id} is taken by {self.workers[worker_id].url}")
        w.id = self._next_id if worker_id is None else worker_id
        self._next_id = max(self._next_id, w.id + 1)
        ranks = max(len(w.sources), w.config.dp_ranks, 1)
        self.cp.add_worker(
            w.id,
            capacity_blocks=w.load.num_gpu_blocks,  # None: the cost model's GPU
            dp_ranks=ranks,
            model=w.base_model,
            tokenizer=self.tokenizer_id,
            max_num_seqs=w.config.max_num_seqs or w.max_num_seqs,
        )
        self.workers[w.id] = w
        try:
            self._probes[w.id] = EngineProbe(w.url)
        except ValueError:
            self._probes[w.id] = None
        self._models = None
        self._serving = {}
        self._limits = {}
        subscribed = []
        try:
            for src in w.sources:
                src = ZmqSourceConfig(
                    worker=w.id,
                    endpoint=src.endpoint,
                    replay_endpoint=src.replay_endpoint,
                    dp_rank=src.dp_rank,
                    topic=src.topic,
                    bind=src.bind,
                    allowed_publishers=self._publishers_of(w) if src.bind else None,
                )
                resume = self.resume_seqs.get((w.id, src.dp_rank), -1)
                self.ingestor.add_zmq_source(src, resume_from=resume)
                subscribed.append(src)
        except OSError as exc:
            # all or nothing: a worker without its events would route blind, and a
            # retry would add it a second time under the next id
            self._forget(w.id)
            if worker_id is None:
                self._next_id = w.id
            raise EventSourceError(
                f"engine {w.url}: {exc}; nothing was added (add it again once the endpoint is free)"
            ) from None
        w.sources = subscribed
        log.info("worker %d: %s serving %s", w.id, w.url, sorted(w.models))
        return w

    def _publishers_of(self, w: Worker) -> tuple[str, ...]:
        """Who may publish to a source bound for `w`: `kv_publishers` when configured,
        else the addresses the engine's own host name resolves to."""
        if self.kv_publishers is not None:
            return tuple(self.kv_publishers)
        host = urlsplit(w.url).hostname or ""
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise DiscoveryError(
                f"engine {w.url}: cannot resolve {host!r} to admit its KV events ({exc}); "
                "set kv_publishers"
            ) from None
        return tuple(sorted({str(info[4][0]) for info in infos}))

    def remove(self, worker_id: int) -> Worker:
        w = self.get(worker_id)
        self._forget(worker_id)
        return w

    def _forget(self, worker_id: int) -> None:
        """Undo `attach`: its sources, its control-plane rows, its probe."""
        self.ingestor.remove_worker(worker_id)
        self.cp.remove_worker(worker_id)
        del self.workers[worker_id]
        probe = self._probes.pop(worker_id, None)
        if probe is not None:
            probe.close()
        self._models = None
        self._serving = {}
        self._limits = {}

    def get(self, worker_id: int) -> Worker:
        try:
            return self.workers[worker_id]
        except KeyError:
            from quillcache.controlplane import UnknownWorkerError

            raise UnknownWorkerError(
                f"unknown worker {worker_id}; known: {sorted(self.workers)}"
            ) from None

    def set_draining(self, worker_id: int, draining: bool) -> None:
        w = self.get(worker_id)
        w.draining = draining
        self.cp.set_draining(worker_id, not w.routable)

    def mark_down(self, worker_id: int, why: str) -> None:
        """No traffic, and forget its cache: it will be relearned from its events."""
        w = self.workers.get(worker_id)
        if w is None or not w.healthy:
            return
        log.warning("worker %d (%s) is down: %s; its residency is dropped", w.id, w.url, why)
        w.healthy = False
        self.cp.set_draining(worker_id, True)
        for rank in range(self.cp.worker(worker_id).dp_ranks):
            self.cp.clear(worker_id, rank)

    def mark_up(self, worker_id: int) -> None:
        w = self.workers.get(worker_id)
        if w is None or w.healthy:
            return
        log.warning("worker %d (%s) is healthy again", w.id, w.url)
        w.healthy = True
        w.failures = 0
        self.cp.set_draining(worker_id, not w.routable)

    # -- models --------------------------------------------------------------------------

    def models(self) -> dict[str, str]:
        """Served model name -> LoRA adapter ("" for a base model), over every worker."""
        if self._models is None:
            self._models = {}
            for w in self.workers.values():
                self._models.update(w.models)
        return self._models

    def serving(self, model: str | None) -> frozenset[int] | None:
        """The workers whose /v1/models list `model` (a base model or a LoRA adapter),
        healthy or not; None when any worker will do (no model named, no workers, or
        every worker serves it: the common case costs the router nothing)."""
        if not model or not self.workers:
            return None
        try:
            return self._serving[model]
        except KeyError:
            pass
        found: frozenset[int] | None = frozenset(
            w.id for w in self.workers.values() if model in w.models
        )
        if found is not None and len(found) == len(self.workers):
            found = None
        self._serving[model] = found
        return found

    def context_limit(self, only: frozenset[int] | None = None) -> int | None:
        """The longest context any of the workers `only` (None: all) takes, in tokens;
        None when one of them did not say (its engine judges each request itself)."""
        try:
            return self._limits[only]
        except KeyError:
            pass
        self._limits[only] = found = self._context_limit(only)
        return found

    def _context_limit(self, only: frozenset[int] | None) -> int | None:
        limit = 0
        for w in self.workers.values():
            if only is None or w.id in only:
                if w.max_model_len is None:
                    return None
                limit = max(limit, w.max_model_len)
        return limit or None

    def any_routable(self, only: frozenset[int] | None = None) -> Worker | None:
        for w in self.workers.values():
            if w.routable and (only is None or w.id in only):
                return w
        return None

    # -- background loops ----------------------------------------------------------------

    async def _fetch_all(
        self, workers: list[Worker], path: str, timeout_s: float = 2.0
    ) -> dict[int, Result]:
        """`GET path` of every engine in `workers`: one round on the probe connections
        (`probe.fetch_all`), httpx for the engines a probe cannot speak to (https)."""
        probes = {w.id: p for w in workers if (p := self._probes.get(w.id)) is not None}
        others = [w for w in workers if w.id not in probes]

        async def by_httpx(w: Worker) -> Result:
            try:
                resp = await self.client.get(f"{w.url}{path}", timeout=timeout_s)
            except httpx.HTTPError as exc:
                return exc
            return resp.status_code, resp.content

        results = await fetch_all(probes, path, timeout_s)
        if others:
            got = await asyncio.gather(*(by_httpx(w) for w in others))
            results.update({w.id: r for w, r in zip(others, got, strict=True)})
        return results

    def close(self) -> None:
        for probe in self._probes.values():
            if probe is not None:
                probe.close()

    async def check_health(self) -> None:
        workers = list(self.workers.values())
        results = await self._fetch_all(workers, "/health")
        now = time.monotonic()
        for w in workers:
            result = results[w.id]
            if isinstance(result, BaseException):
                ok, why = False, f"/health failed: {type(result).__name__}"
            else:
                ok, why = result[0] == 200, f"/health answered {result[0]}"
            w.last_health_s = now
            if w.id not in self.workers:  # removed meanwhile
                continue
            if ok:
                w.failures = 0
                self.mark_up(w.id)
            else:
                w.failures += 1
                if w.failures >= self.failures_to_down:  # one slow answer is not a death
                    self.mark_down(w.id, f"{why} ({w.failures} checks in a row)")

    def _merge_engine_load(self, w: Worker) -> None:
        """The engine may serve clients that bypass this gateway: its own counts raise
        (never lower) the load the gateway tracks from its in-flight requests; per
        rank when the engine reports each data-parallel rank (vLLM's `engine` label)
        and the gateway routes to ranks, else for the engine as a whole.

        What a scrape added is remembered and taken off at the next one: otherwise a
        scrape that saw a request the gateway had just finished would keep it counted
        for good (the max would compare against itself from then on)."""
        state = self.cp.worker(w.id)
        load = w.load
        if state.dp_ranks > 1 and all(r in load.ranks for r in range(state.dp_ranks)):
            for rank in range(state.dp_ranks):
                mine = state.rank_state(rank)
                theirs = load.ranks[rank]
                figures = self._merged(
                    w,
                    rank,
                    mine["in_flight"],
                    mine["running_decodes"],
                    theirs.running,
                    theirs.waiting,
                    theirs.kv_usage,
                )
                if figures is not None:
                    self.cp.update_rank_load(w.id, rank, **figures)
            return
        figures = self._merged(
            w,
            None,
            state.in_flight,
            state.running_decodes,
            load.running,
            load.waiting,
            load.kv_usage,
        )
        if figures is not None:
            self.cp.update_load(w.id, **figures)

    @staticmethod
    def _merged(
        w: Worker,
        rank: int | None,
        in_flight: float,
        decodes: float,
        running: float,
        waiting: float,
        kv_usage: float,
    ) -> dict[str, float] | None:
        """The load to give the plane for `rank` (None: the whole engine), or None when
        it holds these values already (an idle engine, mostly)."""
        scraped_in_flight, scraped_decodes, reported_kv = w.scraped.get(rank, (0, 0, None))
        own_in_flight = max(int(in_flight) - scraped_in_flight, 0)
        own_decodes = max(int(decodes) - scraped_decodes, 0)
        new_in_flight = max(own_in_flight, int(running + waiting))
        new_decodes = max(own_decodes, int(running))
        unchanged = (
            scraped_in_flight == scraped_decodes == 0
            and new_in_flight == own_in_flight == in_flight
            and new_decodes == own_decodes == decodes
            and kv_usage == reported_kv
        )
        w.scraped[rank] = (new_in_flight - own_in_flight, new_decodes - own_decodes, kv_usage)
        if unchanged:
            return None
        return {"kv_usage": kv_usage, "in_flight": new_in_flight, "running_decodes": new_decodes}

    async def scrape(self) -> None:
        workers = [w for w in self.workers.values() if w.healthy]
        results = await self._fetch_all(workers, "/metrics")
        for w in workers:
            result = results[w.id]
            if isinstance(result, BaseException) or result[0] != 200:
                continue
            if result[1] != w.last_metrics_page:  # an idle engine's page does not change
                try:
                    w.load = parse_metrics_fast(result[1])
                except ValueError:
                    continue
                w.last_metrics_page = result[1]
            if w.id in self.workers:
                self._merge_engine_load(w)


async def _addresses(url: str) -> set[tuple[str, str, int, str]]:
    """(scheme, IP address, port, path) for each address `url`'s host resolves to;
    empty when it does not resolve (the description then says why)."""
    parts = urlsplit(url.rstrip("/"))
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return set()
    if parts.hostname is None:
        return set()
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            parts.hostname, port, type=socket.SOCK_STREAM
        )
    except OSError:
        return set()
    return {(parts.scheme, str(info[4][0]), port, parts.path) for info in infos}
