"""The gateway's Prometheus metrics (its own registry, so several gateways can share a
process in tests). Event, index and worker numbers are read at scrape time
(`state_metrics`), not counted twice."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from quillcache.events.chunks import SplitStats
from quillcache.events.groups import FoldStats
from quillcache.gateway.engine_hashes import HASH_STATES
from quillcache.tokenization.multimodal import MultimodalStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_STATE_BUCKETS = (5e-5, 1e-4, 2e-4, 3e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        r = self.registry
        self.requests = Counter(
            "quillcache_requests",
            "Proxied requests by endpoint and status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.decisions = Counter(
            "quillcache_route_decisions",
            "Routing decisions by router, reason and worker.",
            ["router", "reason", "worker"],
            registry=r,
        )
        self.retries = Counter(
            "quillcache_upstream_retries",
            "Requests retried on another worker after a failed connect.",
            ["worker"],
            registry=r,
        )
        self.background_failures = Counter(
            "quillcache_background_job_failures",
            "Runs of a periodic gateway job (the policy tick, polls) that raised; the "
            "log has the traceback.",
            ["task"],
            registry=r,
        )
        self.client_disconnects = Counter(
            "quillcache_client_disconnects",
            "Requests whose client hung up before the answer ended (upstream dropped).",
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "quillcache_predicted_hit_tokens",
            "Prompt tokens the router expected cached.",
            registry=r,
        )
        self.actual_hit_tokens = Counter(
            "quillcache_actual_hit_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens).",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "quillcache_prompt_tokens", "Prompt tokens routed.", registry=r
        )
        self.latency = Histogram(
            "quillcache_request_seconds",
            "End-to-end latency through the gateway.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "quillcache_time_to_first_byte_seconds",
            "Time to the first upstream byte.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        # each routed decision beside the KV-optimal one (controlplane/explain.py): the
        # regret is avoidable - avoided, the share kv_optimal / routed decisions
        self.decisions_kv_optimal = Counter(
            "quillcache_decisions_kv_optimal",
            "Routed requests placed on an engine holding the longest usable prefix among "
            "the candidates (no regret).",
            registry=r,
        )
        self.prefill_tokens_avoidable = Counter(
            "quillcache_prefill_tokens_avoidable",
            "Prompt tokens the candidate holding the longest usable prefix held, per routed "
            "request: what the best placement for the cache would not prefill.",
            registry=r,
        )
        self.prefill_tokens_avoided = Counter(
            "quillcache_prefill_tokens_avoided",
            "Prompt tokens the chosen engine held (its usable prefix), per routed request.",
            registry=r,
        )
        self.route_time = Histogram(
            "quillcache_route_seconds",
            "Time to tokenize, hash and route a request.",
            buckets=_ROUTE_BUCKETS,
            registry=r,
        )

        self.snapshots_served = Counter(
            "quillcache_peer_snapshots_served",
            "GET /admin/snapshot answers by outcome: served, busy (another in progress), "
            "not_ready, unsupported (not the native index), timeout (applier too slow).",
            ["outcome"],
            registry=r,
        )
        self.snapshot_bytes_served = Counter(
            "quillcache_peer_snapshot_bytes_served", "Bytes of peer snapshots sent.", registry=r
        )

        self.slo_rejections = Counter(
            "quillcache_slo_rejections",
            "Requests answered 429 by the SLO admission stage, by the bound the chosen "
            "engine's estimate missed (ttft, tbt).",
            ["bound"],
            registry=r,
        )

    def slo_rejected(self, bound: str) -> None:
        self._child(self.slo_rejections, bound).inc()

    def enable_shared_state(self) -> None:
        """The booking metrics of `--state redis` (absent with local state)."""
        r = self.registry
        self.state_bookings = Counter(
            "quillcache_state_bookings",
            "Bookings through the shared state by outcome: shared (booked in Redis) or "
            "fallback (Redis down or over budget: booked on this replica's local view).",
            ["outcome"],
            registry=r,
        )
        self.state_booking_steps = Counter(
            "quillcache_state_booking_steps",
            "Bookings by the step of the booking rule that chose the engine (docs/state.md): "
            "session, pending (the request's prefix being computed there), under (the "
            "first candidate under its ceiling), over (all at or over their ceilings: the "
            "least overshoot), retry (an earlier attempt's booking), fallback (local).",
            ["step"],
            registry=r,
        )
        self.state_booking_time = Histogram(
            "quillcache_state_booking_seconds",
            "Time of a booking's round trip to Redis (a fallback's time included).",
            buckets=_STATE_BUCKETS,
            registry=r,
        )

    def booked(self, seconds: float, outcome: str, step: str) -> None:
        self._child(self.state_bookings, outcome).inc()
        self._child(self.state_booking_steps, step).inc()
        self.state_booking_time.observe(seconds)

    def request_done(self, endpoint: str, status: int) -> None:
        self._child(self.requests, endpoint, str(status)).inc()

    def decision(self, router: str, reason: str, worker: str) -> None:
        self._child(self.decisions, router, reason, worker).inc()

    def first_byte(self, endpoint: str, seconds: float) -> None:
        self._child(self.ttft, endpoint).observe(seconds)

    def completed(self, endpoint: str, seconds: float) -> None:
        self._child(self.latency, endpoint).observe(seconds)

    def _child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, remembered: prometheus_client takes a lock and
        validates the labels on every `labels()` call, on every request."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def add_collector(self, collect: Callable[[], Iterator[Any]]) -> None:
        class _C:
            def collect(self) -> Iterator[Any]:
                return collect()

        self.registry.register(_C())

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge(name: str, doc: str, samples: dict[tuple[str, ...], float], labels: list[str]) -> Any:
    g = GaugeMetricFamily(name, doc, labels=labels)
    for values, v in samples.items():
        g.add_metric(list(values), v)
    return g


def counter(name: str, doc: str, value: float) -> Any:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


def labelled_counter(
    name: str, doc: str, samples: Mapping[tuple[str, ...], float], labels: list[str]
) -> Any:
    c = CounterMetricFamily(name, doc, labels=labels)
    for values, v in samples.items():
        c.add_metric(list(values), v)
    return c


# (metric name, help, IngestorStats attribute)
_INGEST_COUNTERS = (
    ("quillcache_kv_event_batches_received", "KV event batches received.", "received"),
    ("quillcache_kv_event_batches_applied", "Batches applied to the index.", "applied_batches"),
    (
        "quillcache_kv_event_batches_dropped",
        "Batches dropped by the full ingest queue (replayed later).",
        "dropped",
    ),
    ("quillcache_kv_blocks_stored", "Blocks stored by applied events.", "blocks_stored"),
    ("quillcache_kv_blocks_removed", "Blocks removed by applied events.", "blocks_removed"),
    ("quillcache_kv_event_gaps", "Sequence gaps seen.", "gaps"),
    ("quillcache_kv_event_replays", "Replays requested.", "replays"),
    (
        "quillcache_kv_event_replay_failures",
        "Replays that did not cover their gap.",
        "replay_failures",
    ),
    ("quillcache_kv_source_stale_marks", "Times a source was marked stale.", "stale_marks"),
    ("quillcache_kv_engine_restarts", "Engine restarts seen (seq backwards).", "restarts"),
    (
        "quillcache_kv_engine_restart_suspects",
        "Times an engine's seq went back on the wire (a restart, verified on its replay socket).",
        "restart_suspects",
    ),
    (
        "quillcache_kv_event_implausible_seqs",
        "Frames dropped for a seq beyond everything the engine published (forged or corrupt).",
        "implausible_seqs",
    ),
    ("quillcache_kv_event_malformed", "Frames that could not be read.", "malformed"),
    (
        "quillcache_kv_event_replayed_batches",
        "Batches applied from engines' replay sockets.",
        "replayed_batches",
    ),
    ("quillcache_kv_event_decode_errors", "Undecodable batches.", "decode_errors"),
    (
        "quillcache_kv_event_tail_checks",
        "Replays asked for because a source went quiet after traffic.",
        "tail_checks",
    ),
    (
        "quillcache_kv_event_tail_replayed_batches",
        "Batches such quiet-tail checks found missing (lost with nothing after them).",
        "tail_replayed_batches",
    ),
)
# (metric name, help, key of an `IngestorStats.per_source` row), per worker and rank
_SOURCE_COUNTERS = (
    ("quillcache_kv_source_malformed", "Frames that could not be read, per source.", "malformed"),
    ("quillcache_kv_source_decode_errors", "Undecodable batches, per source.", "decode_errors"),
    (
        "quillcache_kv_source_implausible_seqs",
        "Frames dropped for an implausible seq, per source.",
        "implausible_seqs",
    ),
    (
        "quillcache_kv_source_publishers_denied",
        "Publishers refused by a binding source's allowlist (kv_publishers), per source.",
        "publishers_denied",
    ),
)
_INGEST_GAUGES = (
    ("quillcache_kv_stale_sources", "Sources whose residency is unknown.", "stale_sources"),
    ("quillcache_kv_ingest_queue_depth", "Batches waiting to be applied.", "queue_depth"),
)
# (metric name, help, value of one worker)
_WORKER_GAUGES: tuple[tuple[str, str, Callable[[Any], float]], ...] = (
    (
        "quillcache_worker_engine_running",
        "Engine-reported running requests.",
        lambda w: w.load.running,
    ),
    (
        "quillcache_worker_engine_waiting",
        "Engine-reported waiting requests.",
        lambda w: w.load.waiting,
    ),
    (
        "quillcache_worker_kv_usage",
        "Engine-reported KV-cache usage (0..1).",
        lambda w: w.load.kv_usage,
    ),
    (
        "quillcache_worker_healthy",
        "1 when the worker passes health checks.",
        lambda w: float(w.healthy),
    ),
    (
        "quillcache_worker_parity_ok",
        "1 when the startup parity check passed: the engine's events hold the predicted "
        "content keys and its block hashes are not a mismatch (see "
        "quillcache_worker_hash_parity).",
        lambda w: float(w.parity == "ok"),
    ),
)


def state_metrics(
    ingest: Any, index_stats: Any, workers: list[Any], in_flight: Callable[[int], float]
) -> Iterator[Any]:
    """The scrape-time metrics: the ingestor's `IngestorStats`, the index's stats, and per
    worker its engine-reported load, health, parity and the gateway's in-flight count."""
    for name, doc, attr in _INGEST_COUNTERS:
        yield counter(name, doc, getattr(ingest, attr))
    for name, doc, attr in _INGEST_GAUGES:
        yield gauge(name, doc, {(): getattr(ingest, attr)}, [])
    for name, doc, key in _SOURCE_COUNTERS:
        samples: dict[tuple[str, ...], float] = {
            (str(r["worker"]), str(r["dp_rank"])): r[key] for r in ingest.per_source
        }
        yield labelled_counter(name, doc, samples, ["worker", "dp_rank"])
    yield gauge(
        "quillcache_index_blocks", "Distinct blocks in the index.", {(): index_stats.blocks}, []
    )
    yield gauge(
        "quillcache_index_resident_pairs",
        "(block, source, medium) entries.",
        {(): index_stats.resident_pairs},
        [],
    )
    yield counter(
        "quillcache_index_media_folded",
        "Stored events whose medium name was too long or one unknown name too many, "
        "indexed under the OTHER medium (docs/kv-events.md).",
        index_stats.extra.get("media_folded", 0),
    )
    yield gauge(
        "quillcache_worker_in_flight",
        "Requests in flight per worker.",
        {(str(w.id),): in_flight(w.id) for w in workers},
        ["worker"],
    )
    for name, doc, value in _WORKER_GAUGES:
        yield gauge(name, doc, {(str(w.id),): value(w) for w in workers}, ["worker"])
    yield gauge(
        "quillcache_worker_hash_parity",
        "The engine-hash half of the parity check: 1 for the worker's state (ok, mismatch, "
        "not_predictable, skipped, unchecked), 0 for the others.",
        {
            (str(w.id), state.replace(" ", "_")): float(w.hash_parity.state == state)
            for w in workers
            for state in HASH_STATES
        },
        ["worker", "state"],
    )


def readiness_metrics(state: Any) -> Iterator[Any]:
    """Cold-start progress and readiness (a `readiness.Readiness`): what `/ready` says."""
    yield gauge(
        "quillcache_kv_sources",
        "KV-event sources of the engines the gateway knows.",
        {(): state.sources},
        [],
    )
    yield gauge(
        "quillcache_kv_sources_caught_up",
        "Of those, the ones caught up: connected, and what the engine's replay socket "
        "offered applied (or a first batch off the wire applied).",
        {(): state.caught_up},
        [],
    )
    yield gauge(
        "quillcache_workers_pending",
        "Configured engines not taken in yet (unreachable at start, or their KV-event "
        "socket not open): retried until they join.",
        {(): float(len(state.pending))},
        [],
    )
    yield gauge(
        "quillcache_ready",
        "1 when /ready answers 200: an engine routable and every routable engine's "
        "sources caught up.",
        {(): float(state.ready)},
        [],
    )


def shared_state_metrics(stats: Any, up: bool, moved: int, polls: int) -> Iterator[Any]:
    """The shared state's scrape-time numbers (a `quillcache.state.StateStats`)."""
    yield gauge(
        "quillcache_state_up",
        "1 while Redis is in use; 0 while this replica routes on its local view.",
        {(): float(up)},
        [],
    )
    yield labelled_counter(
        "quillcache_state_fallbacks",
        "Shared-state operations that used the local view instead of Redis, by operation.",
        {(op,): float(n) for op, n in sorted(stats.fallbacks.items())},
        ["op"],
    )
    for name, doc, value in (
        ("quillcache_state_timeouts", "Redis calls over their budget.", stats.timeouts),
        ("quillcache_state_disconnects", "Times Redis became unusable.", stats.disconnects),
        ("quillcache_state_reconnects", "Times Redis came back.", stats.reconnects),
        ("quillcache_state_resyncs", "Share rewritten from this replica's book.", stats.resyncs),
        (
            "quillcache_state_lost_leases",
            "Calls that found this replica's lease gone (Redis restarted or a long pause).",
            stats.lost_leases,
        ),
        (
            "quillcache_state_moved_bookings",
            "Bookings that took another shortlist candidate than the router's choice.",
            moved,
        ),
        (
            "quillcache_state_load_polls",
            "Reads of the fleet's booked load applied to the routers' view.",
            polls,
        ),
        (
            "quillcache_state_bad_shortlists",
            "Router shortlists that broke the shortlist contract, replaced by the one "
            "derived from the router's decision (the request still booked).",
            stats.bad_shortlists,
        ),
    ):
        yield counter(name, doc, float(value))


# (metric name, help, its value)
_FOLD_COUNTERS: tuple[tuple[str, str, Callable[[FoldStats], int]], ...] = (
    (
        "quillcache_kv_grouped_sources",
        "Event sources seen naming a KV-cache group other than 0 (hybrid models), whose "
        "batches are folded into one group.",
        lambda s: s.grouped_sources,
    ),
    (
        "quillcache_kv_group_folded_batches",
        "Batches of grouped sources rewritten into one group (a block kept only where "
        "every group holds it).",
        lambda s: s.folded_batches,
    ),
    (
        "quillcache_kv_group_unplaced_blocks",
        "Blocks of grouped sources' stores whose tokens did not say which block is which "
        "(not indexed).",
        lambda s: s.unplaced_blocks,
    ),
    (
        "quillcache_kv_group_refused_batches",
        "Batches refused for naming more KV-cache groups than a source may have.",
        lambda s: s.refused_batches,
    ),
)


def fold_metrics(stats: FoldStats) -> Iterator[Any]:
    """The KV-cache group folder's counters (`quillcache.events.groups.FoldStats`)."""
    for name, doc, value in _FOLD_COUNTERS:
        yield counter(name, doc, float(value(stats)))


def split_metrics(stats: SplitStats) -> Iterator[Any]:
    """The LMCache chunk splitter's counters (`quillcache.events.chunks.SplitStats`)."""
    yield counter(
        "quillcache_kv_chunks_split",
        "Stored chunks larger than the engine's blocks (LMCache's) cut into engine blocks.",
        float(stats.split_chunks),
    )
    yield counter(
        "quillcache_kv_chunk_blocks",
        "Engine blocks the split chunks became.",
        float(stats.split_blocks),
    )
    yield counter(
        "quillcache_kv_chunk_dropped_tokens",
        "Tokens of short last chunks past their last whole engine block (not indexed).",
        float(stats.dropped_tokens),
    )
    yield counter(
        "quillcache_kv_chunks_misaligned",
        "Chunks off the engine's block boundaries, indexed as they came (never matched "
        "at the engine's block size).",
        float(stats.misaligned_chunks),
    )


def multimodal_metrics(stats: MultimodalStats) -> Iterator[Any]:
    """The gateway's multimodal prompts (`quillcache.tokenization.multimodal`)."""
    outcomes: dict[tuple[str, ...], float] = {
        ("keyed", ""): float(stats.keyed),
        ("refused", ""): float(stats.refused),
    }
    for reason, n in stats.fallbacks.items():
        outcomes[("fallback", reason)] = float(n)
    yield labelled_counter(
        "quillcache_multimodal_requests",
        "Chat bodies with images (requests and /admin/lookup) by outcome: keyed (on "
        "multimodal keys), refused "
        "(a 400: a bad, too large or unreachable image), fallback (routed on their text "
        "alone) with its reason (disabled, kwargs, uuid_only, engine_tokenizes, template, ...).",
        outcomes,
        ["outcome", "reason"],
    )
    yield counter(
        "quillcache_multimodal_items",
        "Images identified in keyed requests (each one multimodal item).",
        float(stats.items),
    )
    yield counter(
        "quillcache_multimodal_fetches",
        "Images fetched by URL (multimodal.fetch), not given inline as data URLs.",
        float(stats.fetched),
    )


def bootstrap_metrics(report: Any) -> Iterator[Any]:
    """The start-up bootstrap from a peer's snapshot (a `bootstrap.BootstrapReport`)."""
    outcomes: dict[tuple[str, ...], float] = {}
    for refusal in report.refusals:
        key = ("refused", refusal["reason"])
        outcomes[key] = outcomes.get(key, 0.0) + 1
    if report.outcome == "loaded":
        outcomes[("loaded", "")] = 1.0
    yield labelled_counter(
        "quillcache_bootstrap_snapshots",
        "Peer snapshots tried at start-up by outcome (loaded, refused) and refusal reason "
        "(corrupt, truncated, version, secret, mismatch, too_large, slow, peer, error).",
        outcomes,
        ["outcome", "reason"],
    )
    yield gauge(
        "quillcache_bootstrap_info",
        "1, labelled with where the index came from at start-up: source url "
        "(--bootstrap-from), redis (a peer advertised there) or none; the outcome.",
        {(report.source, report.peer or "", report.outcome): 1.0},
        ["source", "peer", "outcome"],
    )
    yield gauge(
        "quillcache_bootstrap_blocks_loaded",
        "Blocks taken from the peer's snapshot (after dropping the sources not kept).",
        {(): float(report.blocks_loaded)},
        [],
    )
    yield gauge(
        "quillcache_bootstrap_sources",
        "Event sources of the peer's snapshot kept (replayed from its seq) or dropped "
        "(started cold: engine restarted, replay buffer moved on, not matching here).",
        {("kept",): float(report.sources_kept), ("dropped",): float(report.sources_dropped)},
        ["state"],
    )
    yield gauge(
        "quillcache_bootstrap_seconds",
        "Time of the bootstrap: transfer (the download), load (checks and restore), "
        "total (every peer tried).",
        {
            ("transfer",): report.transfer_s,
            ("load",): report.load_s,
            ("total",): report.duration_s,
        },
        ["phase"],
    )
