"""The gateway's Prometheus metrics (its own registry, so several gateways can share a
process in tests). Event and index numbers are read at scrape time, not counted twice."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_ROUTE_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
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
        self.route_time = Histogram(
            "quillcache_route_seconds",
            "Time to tokenize, hash and route a request.",
            buckets=_ROUTE_BUCKETS,
            registry=r,
        )

    def add_collector(self, collect: Callable[[], Iterator[Any]]) -> None:
        class _C:
            def collect(self) -> Iterator[Any]:
                return collect()

        self.registry.register(_C())  # type: ignore[arg-type]

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
