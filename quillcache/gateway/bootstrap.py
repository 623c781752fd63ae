"""Cold start from a peer: load another replica's index image before subscribing.

A joining replica whose engines' replay buffers no longer reach back to seq 0 cannot
rebuild their residency from the engines alone. A peer that has caught up holds it:
`GET /admin/snapshot` (admin token) streams its index image and, per event source, the
last applied seq and the digest of that batch, taken at one point of its applier
(`peer_snapshot` is the format). Here, before any subscription:

1. fetch it (bounded in bytes and in time: `bootstrap_timeout_s` for the whole
   transfer), verify its checksum and version, and that the peer's secret fingerprint
   is one this replica accepts and that it uses this replica's block size and
   tokenizer id; anything else refuses the whole snapshot;
2. keep a source only if this replica has the same engine (base URL) at the same worker
   id with the same rank and replay socket, and the engine's replay socket still holds
   the snapshot's last seq with the same bytes: then a replay from seq + 1 (which the
   ingestor asks for at subscription) covers everything between the snapshot and now.
   An engine that restarted since (other bytes at that seq, or its stream ends before
   it) or whose buffer has moved on is dropped from the image and starts as it would
   without a snapshot;
3. restore the image, drop the sources not kept, and the peer's pins (pins are
   configuration: this replica's own, or the fleet's from Redis, are applied later).

Any failure (refused, corrupt, truncated, slow, peer down, a check that does not add
up) leaves the replica where it was without a snapshot: a cold start, never a partial
or wrong index. Each refusal is one log line and `quillcache_bootstrap_snapshots_total
{outcome="refused", reason}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
import zmq
from redis.exceptions import RedisError

from quillcache import _native
from quillcache.connectors.replay import Holding, probe_holding
from quillcache.errors import QuillCacheError
from quillcache.gateway.config import GatewayConfig
from quillcache.gateway.peer_snapshot import (
    PeerSnapshot,
    SnapshotError,
    SourceEntry,
    check_prefix,
    decode,
)
from quillcache.gateway.peers import PeerDirectory
from quillcache.index.native import NativeIndex

log = logging.getLogger(__name__)

SNAPSHOT_PATH = "/admin/snapshot"
_ERROR_BODY_BYTES = 4096  # of a peer's refusal, quoted in the log
_PIN_STRIP_ROUNDS = 64


@dataclass(frozen=True)
class LocalSource:
    """One event source this replica will subscribe to (worker id as it will be)."""

    worker: int
    url: str
    dp_rank: int
    endpoint: str
    replay_endpoint: str | None


@dataclass
class BootstrapReport:
    """What the bootstrap did: `/ready`'s body, `/admin/index`, metrics and the log."""

    source: str = "none"  # "url" (--bootstrap-from), "redis" (a peer found there), "none"
    peer: str | None = None  # the peer whose snapshot was loaded
    outcome: str = "none"  # "loaded", "refused" (every peer tried), "none" (nothing to try)
    blocks_loaded: int = 0
    bytes: int = 0
    sources_kept: int = 0
    sources_dropped: int = 0
    transfer_s: float = 0.0  # the snapshot's download
    load_s: float = 0.0  # decode, checks against the engines, restore
    duration_s: float = 0.0  # the whole bootstrap, every peer tried
    refusals: list[dict[str, str]] = field(default_factory=list)  # {peer, reason, message}
    dropped: list[dict[str, Any]] = field(default_factory=list)  # {worker, dp_rank, why}

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class BootstrapResult:
    index: NativeIndex | None  # the restored image; None: start empty as without one
    # (worker, dp_rank) -> (last seq in the image, digest of that batch): resume there
    resume: dict[tuple[int, int], tuple[int, int]]
    report: BootstrapReport


@dataclass(frozen=True)
class Expectations:
    """What a peer's snapshot must agree with to be usable here."""

    secret_fingerprints: Sequence[str]  # accepted (the current one, a previous in window)
    block_size: int
    tokenizer_id: str
    sources: Sequence[LocalSource]


class Bootstrapper:
    def __init__(
        self,
        *,
        token: str | None,
        timeout_s: float,
        max_bytes: int,
        replay_timeout_s: float,
        ctx: zmq.Context | None = None,
    ) -> None:
        self.token = token
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.replay_timeout_s = replay_timeout_s
        self.ctx = ctx or zmq.Context.instance()

    async def run(self, peers: Sequence[tuple[str, str]], expect: Expectations) -> BootstrapResult:
        """Try `peers` ((source label, base URL)) in order; the first usable snapshot wins."""
        started = time.monotonic()
        report = BootstrapReport()
        result = BootstrapResult(None, {}, report)
        for source, url in peers:
            report.source = source
            try:
                result = await self._from_peer(url, expect, report)
            except Exception as exc:  # whatever a peer sends, never a crash: a cold start
                if not isinstance(exc, SnapshotError):
                    log.exception("bootstrap: snapshot from %s failed", url)
                    exc = SnapshotError("error", f"{type(exc).__name__}: {exc}")
                report.refusals.append({"peer": url, "reason": exc.reason, "message": str(exc)})
                log.warning(
                    "bootstrap: snapshot from %s refused (%s): %s; %s",
                    url,
                    exc.reason,
                    exc,
                    "trying the next peer" if (source, url) != peers[-1] else "cold start",
                )
                continue
            report.peer = url
            report.outcome = "loaded"
            break
        else:
            report.outcome = "refused" if peers else "none"
            report.source = report.source if peers else "none"
        report.duration_s = time.monotonic() - started
        if report.outcome == "loaded":
            log.warning(
                "bootstrap: loaded %d blocks from %s (%s) in %.3f s (transfer %.3f s, %d bytes; "
                "load %.3f s); %d sources kept, %d dropped and started cold",
                report.blocks_loaded,
                report.peer,
                report.source,
                report.duration_s,
                report.transfer_s,
                report.bytes,
                report.load_s,
                report.sources_kept,
                report.sources_dropped,
            )
        return result

    async def fetch(self, url: str) -> bytes:
        """The peer's snapshot, whole; `SnapshotError` on anything but a complete one in
        time and within `max_bytes`."""
        headers = {"authorization": f"Bearer {self.token}"} if self.token else {}
        data = bytearray()
        try:
            async with (
                asyncio.timeout(self.timeout_s),
                httpx.AsyncClient(timeout=self.timeout_s) as client,
                client.stream("GET", url.rstrip("/") + SNAPSHOT_PATH, headers=headers) as resp,
            ):
                if resp.status_code != 200:
                    body = b""
                    async for piece in resp.aiter_bytes():
                        body += piece
                        if len(body) >= _ERROR_BODY_BYTES:
                            break
                    text = body[:_ERROR_BODY_BYTES].decode(errors="replace")
                    raise SnapshotError("peer", f"peer answered {resp.status_code}: {text}")
                declared = resp.headers.get("content-length")
                if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
                    raise SnapshotError(
                        "too_large",
                        f"peer snapshot of {declared} bytes over bootstrap_max_bytes "
                        f"{self.max_bytes}",
                    )
                async for piece in resp.aiter_raw():
                    data += piece
                    if len(data) > self.max_bytes:
                        raise SnapshotError(
                            "too_large",
                            f"peer snapshot over bootstrap_max_bytes {self.max_bytes}",
                        )
                    if len(data) - len(piece) < 12:
                        check_prefix(data)
        except TimeoutError:
            raise SnapshotError(
                "slow",
                f"peer snapshot not complete in bootstrap_timeout_s {self.timeout_s} s "
                f"({len(data)} bytes received)",
            ) from None
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.RemoteProtocolError) and data:
                raise SnapshotError(
                    "truncated", f"peer closed the transfer after {len(data)} bytes: {exc}"
                ) from None
            raise SnapshotError("peer", f"peer unreachable: {exc!r}") from None
        return bytes(data)

    async def _from_peer(
        self, url: str, expect: Expectations, report: BootstrapReport
    ) -> BootstrapResult:
        t0 = time.monotonic()
        raw = await self.fetch(url)
        report.transfer_s = time.monotonic() - t0
        report.bytes = len(raw)
        t1 = time.monotonic()
        snap = decode(raw)
        del raw
        self._check_header(snap, expect)
        candidates, dropped = _match_sources(snap.header.sources, expect.sources)
        held = await self._probe(candidates)
        kept: dict[tuple[int, int], SourceEntry] = {}
        for entry, holding in zip(candidates, held, strict=True):
            if holding is Holding.HELD:
                kept[(entry.worker, entry.dp_rank)] = entry
            else:
                dropped.append(_drop(entry, _HOLDING_WHY[holding]))
        index = await asyncio.to_thread(_restore, snap, kept)
        report.load_s = time.monotonic() - t1
        report.blocks_loaded = index.stats().blocks
        report.sources_kept = len(kept)
        report.sources_dropped = len(dropped)
        report.dropped = dropped
        for d in dropped:
            log.warning(
                "bootstrap: worker %s rank %s (%s) not taken from the snapshot: %s",
                d["worker"],
                d["dp_rank"],
                d["url"],
                d["why"],
            )
        resume = {k: (e.last_seq, e.digest) for k, e in kept.items() if e.digest is not None}
        return BootstrapResult(index, resume, report)

    @staticmethod
    def _check_header(snap: PeerSnapshot, expect: Expectations) -> None:
        h = snap.header
        if h.secret_fingerprint not in expect.secret_fingerprints:
            raise SnapshotError(
                "secret",
                f"peer's secret fingerprint {h.secret_fingerprint} is not this replica's "
                f"({', '.join(expect.secret_fingerprints)}): replicas of one fleet must "
                "share the gateway secret",
            )
        if h.block_size != expect.block_size:
            raise SnapshotError(
                "mismatch",
                f"peer uses block size {h.block_size}, this replica {expect.block_size}",
            )
        if h.tokenizer_id != expect.tokenizer_id:
            raise SnapshotError(
                "mismatch",
                f"peer's tokenizer_id {h.tokenizer_id!r} is not this replica's "
                f"{expect.tokenizer_id!r}",
            )

    async def _probe(self, entries: list[SourceEntry]) -> list[Holding]:
        """Ask every kept candidate's replay socket at once (one thread each: a replay
        socket that does not answer costs `replay_timeout_s` once, not once per engine)."""

        async def one(e: SourceEntry) -> Holding:
            assert e.replay_endpoint is not None and e.digest is not None
            return await asyncio.to_thread(
                probe_holding, self.ctx, e.replay_endpoint, e.last_seq, e.digest,
                self.replay_timeout_s,
            )  # fmt: skip

        return list(await asyncio.gather(*(one(e) for e in entries)))


_HOLDING_WHY = {
    Holding.OTHER_BYTES: "the engine restarted since (its replay holds other bytes at that seq)",
    Holding.NOT_PUBLISHED: "the engine restarted since (its stream ends before that seq)",
    Holding.BUFFER_MOVED_ON: "the engine's replay buffer no longer reaches back to that seq",
    Holding.NO_ANSWER: "the engine's replay socket did not answer",
}


def _drop(entry: SourceEntry, why: str) -> dict[str, Any]:
    return {
        "worker": entry.worker,
        "dp_rank": entry.dp_rank,
        "url": entry.url,
        "last_seq": entry.last_seq,
        "why": why,
    }


def _match_sources(
    entries: Sequence[SourceEntry], local: Sequence[LocalSource]
) -> tuple[list[SourceEntry], list[dict[str, Any]]]:
    """The peer's exact sources that are the same source here (same worker id, engine
    URL, rank and replay socket), and why the others are not taken."""
    mine = {(s.worker, s.dp_rank): s for s in local}
    candidates: list[SourceEntry] = []
    dropped: list[dict[str, Any]] = []
    for e in entries:
        here = mine.get((e.worker, e.dp_rank))
        if not e.exact:
            dropped.append(_drop(e, f"not exact on the peer: {e.why}"))
        elif here is None or here.url != e.url:
            what = "no such source" if here is None else here.url
            dropped.append(_drop(e, f"this replica's worker {e.worker} is {what}"))
        elif here.replay_endpoint != e.replay_endpoint or e.replay_endpoint is None:
            dropped.append(_drop(e, "another replay socket here"))
        elif e.digest is None or e.last_seq < 0:
            dropped.append(_drop(e, "no position"))
        else:
            candidates.append(e)
    return candidates, dropped


def _restore(snap: PeerSnapshot, kept: dict[tuple[int, int], SourceEntry]) -> NativeIndex:
    """The image with only the kept sources' residency and no pins; `SnapshotError` when
    the image does not restore or does not hold the sources its header lists."""
    try:
        inner = _native.NativeIndex.from_snapshot(snap.image)
    except QuillCacheError as exc:
        raise SnapshotError("corrupt", f"index image does not restore: {exc}") from None
    ranks: dict[int, set[int]] = {}
    for e in snap.header.sources:
        ranks.setdefault(e.worker, set()).add(e.dp_rank)
    registered = 0
    for worker, rs in ranks.items():
        keep = {r for r in rs if (worker, r) in kept}
        if not keep:
            inner.remove_worker(worker)
            continue
        registered += len(rs)
        for r in rs - keep:
            inner.clear_source(worker, r)
    _, _, _, sources, pinned, *_ = inner.stats()
    if sources != registered:
        raise SnapshotError(
            "corrupt",
            f"index image holds {sources} sources where its header leaves {registered}",
        )
    if pinned:
        _strip_pins(inner)
    return NativeIndex(_inner=inner)


def _strip_pins(inner: _native.NativeIndex) -> None:
    """Unpin every pinned path (a pin pins its whole path: unpinning each deepest
    pinned block's path, as often as it takes, leaves none)."""
    for _ in range(_PIN_STRIP_ROUNDS):
        pinned = {key: parent for key, parent, _, _, is_pinned in inner.entries() if is_pinned}
        if not pinned:
            return
        parents = set(pinned.values())
        for leaf in [k for k in pinned if k not in parents]:
            path = [leaf]
            while (parent := pinned.get(path[-1])) is not None and parent in pinned:
                path.append(parent)
            inner.unpin(np.asarray(path[::-1], dtype=np.uint64))
    if inner.stats()[4]:
        raise SnapshotError("corrupt", "the image's pins could not be removed")


def local_sources(workers: Sequence[Any]) -> list[LocalSource]:
    """The sources the described engines will have, by the worker ids they will get
    (the pool numbers the configured engines 0, 1, ... in order at start-up)."""
    return [
        LocalSource(i, w.url, s.dp_rank, s.endpoint, s.replay_endpoint)
        for i, w in enumerate(workers)
        for s in w.sources
    ]


async def peers_to_try(
    cfg: GatewayConfig, directory: PeerDirectory | None, own_url: str | None
) -> list[tuple[str, str]]:
    """(source label, base URL) of the peers to ask, in order: `bootstrap_from`, else the
    ready replicas advertised in Redis (none when Redis does not answer: a cold start)."""
    if cfg.bootstrap_from:
        return [("url", u) for u in cfg.bootstrap_from]
    if directory is None or not cfg.bootstrap_discover or cfg.index != "native":
        return []
    try:
        async with asyncio.timeout(cfg.bootstrap_timeout_s):
            found = await directory.peers(exclude=own_url)
    except (TimeoutError, RedisError, OSError) as exc:
        log.warning("bootstrap: cannot list peers in Redis (%s); cold start", exc)
        return []
    if not found:
        log.info("bootstrap: no ready peer advertised in Redis; cold start")
    return [("redis", u) for u in found]
