"""What becomes of a routed request, booked in one place for both data paths.

The ASGI path (`openai_api`) and the native relay's (`relay`) see the same moments — a
decision, the first byte, an engine failing, the client leaving, the end — and each one
must release the request's load in the control plane, tell the ingestor to expect the
engine's events, take a failing engine out of rotation and count it, exactly once.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from quillcache.connectors import EventIngestor
from quillcache.controlplane import ControlPlane
from quillcache.controlplane.explain import Explanation
from quillcache.gateway.metrics import GatewayMetrics
from quillcache.gateway.shared_routing import SharedRouting
from quillcache.gateway.workers import WorkerPool


@dataclass(slots=True)
class LatencySamples:
    """The gateway's own recent latencies, for /admin/index (seconds)."""

    # tokenize + hash + route
    route: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=20_000)
    )
    # handler entry -> upstream request issued (parse, auth, tokenize, hash, route)
    pre_upstream: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=20_000)
    )
    # upstream chunk received -> written to the client, per streamed chunk
    relay: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=50_000)
    )

    def by_name(self) -> dict[str, collections.deque[float]]:
        return {
            "route_latency_us": self.route,
            "pre_upstream_us": self.pre_upstream,
            "relay_chunk_us": self.relay,
        }


class DecisionLog:
    """The last `capacity` sampled decisions with their explanation and candidates, for
    `GET /admin/decisions`. At most one decision per `interval_s` is sampled: the cost
    (listing the candidates, one dict kept) is bounded per second, whatever the rate;
    under light traffic every decision is."""

    def __init__(self, capacity: int = 256, interval_s: float = 0.05) -> None:
        self.capacity = capacity
        self.interval_s = interval_s
        self.entries: collections.deque[dict[str, Any]] = collections.deque(maxlen=capacity)
        self._last_s = -float("inf")

    def sample(self) -> bool:
        """Whether the decision about to be made is sampled (then `add` it)."""
        now = time.monotonic()
        if now - self._last_s < self.interval_s:
            return False
        self._last_s = now
        return True

    def add(
        self,
        request_id: int | str,
        router: str,
        why: Explanation,
        parent_id: int | str | None = None,
    ) -> None:
        """`parent_id`: the request it follows, from the client's parent hint."""
        self.entries.append(
            {
                "request_id": request_id,
                "parent_request_id": parent_id,
                "unix_s": time.time(),
                "router": router,
                **why.as_dict(),
            }
        )


class RequestOutcomes:
    def __init__(
        self,
        *,
        plane: ControlPlane,
        ingestor: EventIngestor,
        pool: WorkerPool,
        metrics: GatewayMetrics,
        router_name: str,
    ) -> None:
        self._plane = plane
        self._ingestor = ingestor
        self._pool = pool
        self.metrics = metrics
        self.router_name = router_name
        self.samples = LatencySamples()
        self.decisions = DecisionLog()
        # with shared state, the booking in Redis follows the plane's (None: local state)
        self.shared: SharedRouting | None = None

    def _release(self, request_id: int | str) -> None:
        self._plane.finish(request_id)
        if self.shared is not None:
            self.shared.release(request_id)

    # -- the decision --------------------------------------------------------------------

    def routed(
        self,
        worker_id: int,
        reason: str,
        routed_s: float,
        cached_tokens: int,
        prompt_tokens: int,
        *,
        request_id: int | str = "",
        explanation: Explanation | None = None,
        parent_id: int | str | None = None,
    ) -> None:
        m = self.metrics
        m.route_time.observe(routed_s)
        self.samples.route.append(routed_s)
        m.decision(self.router_name, reason, str(worker_id))
        m.predicted_hit_tokens.inc(cached_tokens)
        m.prompt_tokens.inc(prompt_tokens)
        if explanation is not None:
            if explanation.is_kv_optimal:
                m.decisions_kv_optimal.inc()
            m.prefill_tokens_avoidable.inc(explanation.avoidable_tokens)
            m.prefill_tokens_avoided.inc(explanation.avoided_tokens)
            self._log(request_id, explanation, parent_id)

    def not_routed(
        self,
        request_id: int | str,
        reason: str,
        routed_s: float | None,
        explanation: Explanation | None = None,
    ) -> None:
        """A rejection (or a router error, `routed_s` None): nothing was booked to keep."""
        if routed_s is not None:
            self.metrics.route_time.observe(routed_s)
            self.samples.route.append(routed_s)
            self._plane.finish(request_id)
        self.metrics.decision(self.router_name, reason[:60], "none")
        if explanation is not None:
            self._log(request_id, explanation)

    def _log(
        self, request_id: int | str, explanation: Explanation, parent_id: int | str | None = None
    ) -> None:
        # sampled decisions are the ones routed with their candidates listed
        if explanation.candidates:
            self.decisions.add(request_id, self.router_name, explanation, parent_id)

    def forwarding(self, since_entry_s: float) -> None:
        self.samples.pre_upstream.append(since_entry_s)

    # -- upstream ------------------------------------------------------------------------

    def first_byte(self, path: str, elapsed_s: float, request_id: int | str) -> None:
        self.metrics.first_byte(path, elapsed_s)
        # the clock `route` is given (openai_api.py): the observed TTFT teaches the
        # plane each engine's pace
        self._plane.prefill_done(request_id, time.monotonic())
        if self.shared is not None:
            self.shared.prefill_done(request_id)

    def cached_tokens(self, tokens: int) -> None:
        """What the engine reported cached (`usage.prompt_tokens_details.cached_tokens`)."""
        self.metrics.actual_hit_tokens.inc(tokens)

    def released(self, request_id: int | str) -> None:
        """The request holds no engine any more (idempotent): failed, retried or delegated."""
        self._release(request_id)

    def engine_failed(
        self, request_id: int | str, worker_id: int, why: str, *, retry: bool
    ) -> None:
        """The engine gave no answer: release the request, take the engine out of
        rotation and, when the request goes to another one, count the retry."""
        self._release(request_id)
        self._pool.mark_down(worker_id, why)
        if retry:
            self.metrics.retries.labels(str(worker_id)).inc()

    def tokenize_retry(self, worker_id: int) -> None:
        self.metrics.retries.labels(str(worker_id)).inc()

    def client_left(self, request_id: int | str) -> None:
        """The client hung up before the engine answered."""
        self._release(request_id)
        self.metrics.client_disconnects.inc()

    def answer_over(self, request_id: int | str, worker_id: int) -> None:
        """The engine's answer is over: release the request; its events are expected
        even if every one of them is lost."""
        self._release(request_id)
        self._ingestor.expect_events(worker_id)

    def engine_broke(self, worker_id: int, why: str) -> None:
        """The engine failed after it began answering: out of rotation, no retry."""
        self._pool.mark_down(worker_id, why)

    def whole_answer(self, path: str, elapsed_s: float) -> None:
        """A non-streamed answer: its first byte came with its end."""
        self.metrics.first_byte(path, elapsed_s)
        self.metrics.completed(path, elapsed_s)

    def ended(
        self,
        path: str,
        request_id: int | str,
        worker_id: int,
        elapsed_s: float,
        *,
        broke: str | None = None,
        client_left: bool = False,
    ) -> None:
        """A streamed or relayed answer ended: whole, broken by the engine (`broke` says
        how), or cut by the client."""
        self.answer_over(request_id, worker_id)
        if broke is not None:
            self._pool.mark_down(worker_id, broke)
        elif client_left:
            self.metrics.client_disconnects.inc()
        self.metrics.completed(path, elapsed_s)

    def answered(self, path: str, status: int) -> None:
        """Every answer, error or not, counted by endpoint and status."""
        self.metrics.request_done(path, status)
