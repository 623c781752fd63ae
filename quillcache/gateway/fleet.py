"""The gateway's side of `--state redis://...`: several replicas of one fleet sharing
what each learns from its own traffic through Redis (docs/state.md, "How the gateway
uses it").

`FleetLink` owns, for one replica:

- the `RedisFleetState` (lease, heartbeat, fail-open, resync: `quillcache/state/`);
- the plane's `SharedLoadStore`: the fleet's booked load, polled every `state_poll_s`,
  plus this replica's own bookings applied at once;
- the booking step (`SharedRouting`), which the request path calls after the plane's
  decision, and which `RequestOutcomes` tells of first bytes and ends;
- the admin changes the fleet shares: engines added or removed through the admin API,
  draining flags and pins go to Redis, and every replica applies the fleet's version
  when it changes (a replica starting later applies it before it serves).

Engines are named in Redis by `fleet_engine_id(url)`, so replicas agree on them whatever
order they learnt them in. A change made through the admin API while Redis is
unreachable is applied to this replica only (the answer says `"shared": false`); the
fleet's version replaces it when Redis is back and the fleet's configuration changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from quillcache.controlplane import ControlPlane
from quillcache.gateway.config import GatewayConfig, WorkerConfig
from quillcache.gateway.metrics import GatewayMetrics, shared_state_metrics
from quillcache.gateway.secret import GatewaySecret
from quillcache.gateway.shared_routing import EngineIds, SharedRouting, ViewCapture
from quillcache.gateway.workers import DuplicateWorkerError, Worker, WorkerPool
from quillcache.state import EngineKey, FleetConfig, LocalFallback, PinRecord, RedisFleetState
from quillcache.state.load_store import SharedLoadStore
from quillcache.state.shortlist import ShortlistPolicy
from quillcache.state.urls import redacted

log = logging.getLogger(__name__)

# The configuration is read when the version `loads()` reports moved, and at least this
# often: reading it also expires lapsed pins (which then moves the version).
CONFIG_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class AdoptedPin:
    """A pin of the fleet, as another replica made it."""

    prefix_key: int
    keys: npt.NDArray[np.uint64]
    owner: str
    record: PinRecord
    ttl_left_s: float


#: A pin a replica keeps: its keys, owner tenant, TTL left (s) and what warming it takes.
KeptPin = tuple[npt.NDArray[np.uint64], str, float, PinRecord]


class FleetLink:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config = config
        self.metrics = metrics
        self.state = RedisFleetState(
            config.state,
            prefix=config.state_prefix,
            lease_ttl_s=config.state_lease_ttl_s,
            budget_s=config.state_budget_s,
        )
        self.store = SharedLoadStore()
        self.ids = EngineIds()
        self.routing: SharedRouting
        self._plane: ControlPlane
        self._pool: WorkerPool
        self._on_added: Callable[[Worker], None] = lambda w: None
        self._version = -1  # the fleet configuration last applied
        self._config_read_at = -float("inf")  # loop time of the last config() read
        self._fleet_engines: set[int] = set()  # fleet ids of engines added through the fleet
        self._pins: dict[int, npt.NDArray[np.uint64]] = {}  # prefix key -> its chain, applied
        self._pin_owners: dict[int, str] = {}  # prefix key -> owner tenant, as last read
        self._task: asyncio.Task[None] | None = None
        self._on_pin: Callable[[AdoptedPin], None] | None = None
        self._kept_pins: Callable[[], list[KeptPin]] = list
        self._epoch = ""  # the fleet's epoch in Redis when its configuration was last read
        self.restores = 0  # configurations put back after Redis lost them
        metrics.enable_shared_state()

    async def start(self, secret: GatewaySecret) -> None:
        """Join the fleet; `SecretMismatchError` (a ConfigError) refuses the start."""
        await self.state.start(secret)
        if not self.state.healthy:
            log.warning(
                "shared state: redis at %s unreachable at start; routing on local state "
                "until it comes",
                redacted(self.config.state),
            )

    def bind(
        self, plane: ControlPlane, pool: WorkerPool, on_added: Callable[[Worker], None]
    ) -> SharedRouting:
        """Wire the plane (built with `self.store`) and the pool; the booking step."""
        self._plane, self._pool, self._on_added = plane, pool, on_added
        capture = ViewCapture(plane.router)
        plane.router = capture

        def row_of(key: EngineKey) -> int | None:
            worker = self.ids.to_worker.get(key.engine)
            if worker is None:
                return None
            rows = plane.worker(worker).rows
            return rows[key.rank] if 0 <= key.rank < len(rows) else None

        self.store.bind(row_of)
        self.routing = SharedRouting(
            self.state,
            self.store,
            capture,
            self.ids,
            block_size=plane.block_size,
            policy=ShortlistPolicy(
                size=self.config.state_shortlist, cache_slack=self.config.state_cache_slack
            ),
            spec_ttl_s=plane.speculative_ttl_s,
            on_booked=self.metrics.booked,
        )
        return self.routing

    def attached(self, w: Worker) -> None:
        self.ids.add(w.id, w.url)

    def begin(self) -> None:
        self._task = asyncio.create_task(self._poll(), name="fleet-poll")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.state.close()

    # -- polling -------------------------------------------------------------------------

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.config.state_poll_s)
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the poll must outlive anything one round can raise
                log.exception("shared state: poll failed")

    async def poll_once(self) -> None:
        """The fleet's load; its configuration when its version moved (the load's
        round trip reads the version), or every `CONFIG_EVERY_S`."""
        loads = await self.state.loads()
        if not isinstance(loads, LocalFallback):
            self.store.apply_snapshot(loads)
        now = asyncio.get_running_loop().time()
        if (
            self.state.config_version != self._version
            or now - self._config_read_at >= CONFIG_EVERY_S
        ):
            await self.apply_config()

    async def apply_config(self) -> None:
        """The fleet's engines, draining flags and pins, when their version moved."""
        cfg = await self.state.config()
        if isinstance(cfg, LocalFallback):
            return
        self._config_read_at = asyncio.get_running_loop().time()
        epoch = self.state.epoch
        if self._epoch and not epoch:  # the fleet's meta is gone: wait for a new epoch
            return
        if self._epoch and epoch != self._epoch:
            # Redis lost the fleet's configuration (restarted empty, or flushed) since
            # this replica last read it: an engine missing now was not removed
            await self._restore()
            self._epoch = epoch
            return  # the configuration is read again at the next poll
        self._epoch = epoch
        if cfg.version == self._version:
            return
        done = await self._apply_engines(cfg)
        self._apply_draining(cfg)
        done = await self._apply_pins(cfg) and done
        if done:
            self._version = cfg.version

    async def _restore(self) -> None:
        """Put back in Redis what this replica knows of the fleet's configuration: the
        engines added through the fleet that it serves, its draining flags, and the pins
        its policy engine keeps (every replica keeps every pin it read, with its TTL
        left: `pins_from`). Every replica does the same; the writes are idempotent (a
        pin's owner re-pinning it)."""
        self.restores += 1
        pins = 0
        for keys, owner, ttl_s, record in self._kept_pins():
            if ttl_s > 0 and (await self.pin(keys, owner, ttl_s, record)).get("shared"):
                pins += 1
        put = 0
        for fid in sorted(self._fleet_engines):
            worker = self.ids.to_worker.get(fid)
            w = self._pool.workers.get(worker) if worker is not None else None
            if w is None:
                continue
            spec = w.config.model_dump(exclude_defaults=True)
            put += _shared(await self.state.add_engine(fid, spec))
        for fid, worker in sorted(self.ids.to_worker.items()):
            w = self._pool.workers.get(worker)
            if w is not None and w.draining:
                await self.state.set_draining(EngineKey(fid), True)
        log.warning(
            "shared state: redis lost the fleet's configuration (epoch changed); this "
            "replica put back %d engine(s) added through the fleet, its draining flags and "
            "%d pin(s)",
            put,
            pins,
        )

    async def _apply_engines(self, cfg: FleetConfig) -> bool:
        done = True
        for fid, spec in cfg.engines.items():
            if fid in self.ids.to_worker:
                # in this replica already (its own configuration, or added here): the
                # fleet removing it does not remove a configured engine
                continue
            self._fleet_engines.add(fid)
            try:
                w = await self._pool.add(WorkerConfig.model_validate(spec))
            except DuplicateWorkerError as exc:  # served here already, under another URL
                log.info("shared state: fleet engine %s not added: %s", spec.get("url"), exc)
                continue
            except Exception as exc:  # retried at the next poll
                done = False
                log.warning("shared state: cannot add fleet engine %s: %s", spec.get("url"), exc)
                continue
            self.attached(w)
            self._on_added(w)
            log.info("shared state: engine %s added by the fleet as worker %d", w.url, w.id)
        for fid in list(self._fleet_engines - set(cfg.engines)):
            self._fleet_engines.discard(fid)
            worker = self.ids.to_worker.get(fid)
            if worker is not None and worker in self._pool.workers:
                self._pool.remove(worker)
                self.ids.remove(worker)
                log.info("shared state: worker %d removed by the fleet", worker)
        return done

    def _apply_draining(self, cfg: FleetConfig) -> None:
        draining = {k.engine for k in cfg.draining}
        for fid, worker in list(self.ids.to_worker.items()):
            w = self._pool.workers.get(worker)
            if w is not None and w.draining != (fid in draining):
                self._pool.set_draining(worker, fid in draining)

    async def _apply_pins(self, cfg: FleetConfig) -> bool:
        new = [k for k in cfg.pins if k not in self._pins]
        if new:
            chains = await self.state.pin_chains(new)
            if isinstance(chains, LocalFallback):
                return False
            for key, chain in chains.items():
                keys = np.asarray(chain, dtype=np.uint64)
                self._plane.pin(keys)
                self._pins[key] = keys
            await self._adopt([k for k in new if k in chains], cfg)
            if len(chains) < len(new):  # a chain not written yet: again at the next poll
                return False
        for key in [k for k in self._pins if k not in cfg.pins]:
            self._plane.unpin(self._pins.pop(key))
        self._pin_owners = dict(cfg.pins)
        return True

    def pins_from(self, kept: Callable[[], list[KeptPin]]) -> None:
        """The pins this replica's policy engine keeps (keys, owner, TTL left, record):
        what it puts back when Redis lost the fleet's configuration."""
        self._kept_pins = kept

    def on_pin(self, adopt: Callable[[AdoptedPin], None]) -> None:
        """Who keeps the fleet's pins warm on this replica (the policy engine): each pin
        made through another replica, with what warming it takes and its TTL left."""
        self._on_pin = adopt

    async def _adopt(self, keys: list[int], cfg: FleetConfig) -> None:
        """Hand the pins `keys` (new to this replica) to `on_pin`: every replica keeps
        every pin warm (the fleet's warm claims let one warm request through), so a pin
        outlives the replica it was made through."""
        if self._on_pin is None or not keys:
            return
        records = await self.state.pin_records(keys)
        ttls = await self.state.pin_ttls(keys)
        if isinstance(records, LocalFallback) or isinstance(ttls, LocalFallback):
            return  # adopted when the pin is next read (a restart, or a new version)
        for key in keys:
            record, ttl = records.get(key), ttls.get(key)
            if record is None or ttl is None:  # made before records, or expired since
                continue
            self._on_pin(AdoptedPin(key, self._pins[key], cfg.pins.get(key, ""), record, ttl))

    async def pins_elsewhere(self, here: set[int]) -> list[dict[str, Any]]:
        """For `GET /admin/pins`: the fleet's pins whose prefix key is not in `here`
        (the pins this replica keeps warm): ones it has not taken (Redis was down when
        it read them, or they carry no record), which the replica they were made through
        warms; this one prefers their holders all the same. Their `ttl_left_s` is
        Redis's (None when Redis cannot be asked now); a pin that expired since the last
        poll is not listed."""
        theirs = sorted((k, keys) for k, keys in self._pins.items() if k not in here)
        got = await self.state.pin_ttls([k for k, _ in theirs])
        ttls: dict[int, float | None] = (
            dict.fromkeys((k for k, _ in theirs), None)
            if isinstance(got, LocalFallback)
            else dict(got)
        )
        out = []
        for key, keys in theirs:
            if key not in ttls:  # expired since the last poll
                continue
            ttl = ttls[key]
            out.append(
                {
                    "kind": "pin",
                    "prefix_key": f"{key:016x}",
                    "owner": self._pin_owners.get(key, ""),
                    "blocks": len(keys),
                    "ttl_left_s": ttl,
                    "holders": sorted(self._plane.holders(keys)),
                    "kept_warm_by": "another replica",
                }
            )
        return out

    # -- what the admin API changes ------------------------------------------------------

    async def engine_added(self, w: Worker) -> bool:
        fid = self.ids.add(w.id, w.url)
        self._fleet_engines.add(fid)
        spec = w.config.model_dump(exclude_defaults=True)
        return _shared(await self.state.add_engine(fid, spec))

    async def engine_removed(self, w: Worker) -> bool:
        """Whether the removal is the fleet's: an engine added through the fleet leaves
        every replica; one in this replica's own configuration leaves this one only
        (False: nothing is written)."""
        fid = self.ids.to_fleet.get(w.id)
        self.ids.remove(w.id)
        if fid is None or fid not in self._fleet_engines:
            return False
        self._fleet_engines.discard(fid)
        return _shared(await self.state.remove_engine(fid))

    async def drained(self, w: Worker, draining: bool) -> bool:
        fid = self.ids.to_fleet.get(w.id)
        if fid is None:
            return False
        return _shared(await self.state.set_draining(EngineKey(fid), draining))

    async def pin(
        self, keys: npt.NDArray[np.uint64], tenant: str, ttl_s: float, record: PinRecord
    ) -> dict[str, Any]:
        """Pin a prompt's blocks on every replica: the prefix (its last key) in Redis
        with its chain and what warming it takes (`record`), then here. 409 material
        when another tenant holds it."""
        if not len(keys):
            return {"pinned": 0, "shared": False}
        last = int(keys[-1])
        # the chain and record first: a replica that sees the pin finds what to pin
        await self.state.put_pin_chain(last, [int(k) for k in keys])
        await self.state.put_pin_record(last, record)
        out = await self.state.pin(last, tenant, ttl_s)
        if isinstance(out, LocalFallback):
            self._pin_here(last, keys)
            return {"pinned": len(keys), "shared": False}
        if not out.pinned:
            return {"pinned": 0, "shared": True, "owner": out.owner}
        self._pin_here(last, keys)
        return {"pinned": len(keys), "shared": True}

    async def unpin(self, keys: npt.NDArray[np.uint64], tenant: str) -> dict[str, Any]:
        if not len(keys):
            return {"unpinned": 0, "shared": False}
        last = int(keys[-1])
        out = await self.state.unpin(last, tenant)
        if not isinstance(out, LocalFallback) and out.pinned:
            return {"unpinned": 0, "shared": True, "owner": out.owner}
        if not isinstance(out, LocalFallback):
            await self.state.drop_pin_chain(last)
        held = self._pins.pop(last, None)
        if held is not None:
            self._plane.unpin(held)
        return {"unpinned": len(keys) if held is not None else 0, "shared": _shared(out)}

    def _pin_here(self, last: int, keys: npt.NDArray[np.uint64]) -> None:
        if last not in self._pins:
            self._plane.pin(keys)
            self._pins[last] = keys

    def status(self) -> dict[str, Any]:
        """For /admin/index: this replica's link to the fleet."""
        return {
            "url": redacted(self.config.state),
            "prefix": self.state.prefix,
            "replica": self.state.replica,
            "redis_in_use": self.state.healthy,
            "config_version": self._version,
            "pins": len(self._pins),
            "fleet_engines": len(self._fleet_engines),
            "configuration_restores": self.restores,
            "own_bookings": self.routing.in_flight if hasattr(self, "routing") else 0,
        }

    # -- metrics -------------------------------------------------------------------------

    def collect(self) -> Iterator[Any]:
        routing = getattr(self, "routing", None)
        yield from shared_state_metrics(
            self.state.stats,
            self.state.healthy,
            routing.moved if routing is not None else 0,
            self.store.polls,
        )


def _shared(out: object) -> bool:
    return not isinstance(out, LocalFallback)
