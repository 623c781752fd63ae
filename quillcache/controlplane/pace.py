"""Which engines are slower than the rest: each engine's pace, learned from the requests'
observed time to first token.

The cost model has one speed for the whole fleet, but fleets are not uniform: an older GPU
generation beside newer ones, a throttled or degraded card, an engine sharing its GPU. A
router that prices every engine at the fleet's speed keeps sending such an engine its
share of the work, and that engine's queue sets the fleet's tail latency.

The control plane knows, for each request it tracks, the TTFT its decision estimated and
(when the caller passes the time to `prefill_done`) the TTFT that happened. Per engine
row, `PaceLearner` keeps its last `window` requests and takes the ratio of their summed
observed to their summed estimated TTFT. A sum, not a mean of ratios: a short prompt
that shares its engine step with a long one that arrived after it sees its first token
many times later than estimated, on any engine; the long prompts, whose estimates
carry the time, decide the ratio. The
estimate's own errors (a queue the engine never reported, decode interference, a cost
model calibrated for another GPU) are shared by every engine, so the learner compares
each row with the fleet's median rather than with 1: a row whose ratio is `on_ratio`
times the median's or more gets that ratio as its pace; it keeps a pace until its ratio
falls below `off_ratio` (hysteresis: an engine is not flagged and cleared on every
refresh). The other rows keep pace 1.0 exactly, so a uniform fleet routes exactly as
without the learner.

A pace is at least 1.0: the learner finds engines slower than the median, never faster
ones. That keeps the native walk's lower bound valid (a score only grows with the pace;
`quill_lowest_walk` bounds the rows it skips at pace 1.0).

A slowed engine receives few requests, so its pace changes only as often as it is sent
one; an engine that recovers is cleared on its next requests, not by the clock.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from quillcache.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PaceConfig:
    """How `PaceLearner` decides. `window`: the samples a row's median is taken over;
    `min_samples`: a row's samples before it counts (in the fleet's median and for a
    pace); `min_rows`: rows with enough samples before any row gets a pace;
    `refresh_every`: samples between two refreshes (at least an eighth of the rows)."""

    window: int = 16
    min_samples: int = 8
    min_rows: int = 3
    on_ratio: float = 2.0
    off_ratio: float = 1.6
    max_pace: float = 100.0
    refresh_every: int = 32

    def __post_init__(self) -> None:
        if not 1 <= self.min_samples <= self.window:
            raise ConfigError(
                f"pace min_samples must be in [1, window={self.window}], got {self.min_samples}"
            )
        if self.min_samples < 1 or self.min_rows < 2 or self.refresh_every < 1:
            raise ConfigError(
                "pace min_samples and refresh_every must be >= 1 and min_rows >= 2, got "
                f"{self.min_samples}, {self.refresh_every}, {self.min_rows}"
            )
        if not 1.0 < self.off_ratio <= self.on_ratio <= self.max_pace:
            raise ConfigError(
                "pace ratios must satisfy 1 < off_ratio <= on_ratio <= max_pace, got "
                f"{self.off_ratio}, {self.on_ratio}, {self.max_pace}"
            )


class PaceLearner:
    """Per engine row: its observed against its estimated TTFT, and the pace that
    implies. `set_pace(row, pace)` writes a row's pace where the routers read it."""

    def __init__(
        self, set_pace: Callable[[int, float], None], config: PaceConfig | None = None
    ) -> None:
        self.config = config or PaceConfig()
        self._set_pace = set_pace
        # the row's last `window` (observed, estimated) pairs
        self._recent: dict[int, deque[tuple[float, float]]] = {}
        # log(sum observed / sum estimated) of `_recent`, for the rows that have enough
        self._ratio: dict[int, float] = {}
        self._changed: set[int] = set()  # rows with samples since the last refresh
        self._pace: dict[int, float] = {}  # rows whose pace is not 1.0
        self._since_refresh = 0

    @property
    def paced(self) -> bool:
        """True when some row's pace is not 1.0."""
        return bool(self._pace)

    def pace(self, row: int) -> float:
        return self._pace.get(row, 1.0)

    def observe(self, row: int, observed_s: float, estimated_s: float) -> None:
        """A request routed to `row` saw its first token `observed_s` after routing; the
        decision had estimated `estimated_s`. Non-positive or non-finite figures (a
        clock that went back, no estimate) teach nothing."""
        if not (0.0 < observed_s < math.inf and 0.0 < estimated_s < math.inf):
            return
        recent = self._recent.get(row)
        if recent is None:
            recent = self._recent[row] = deque(maxlen=self.config.window)
        recent.append((observed_s, estimated_s))
        self._changed.add(row)
        self._since_refresh += 1
        if self._since_refresh >= max(self.config.refresh_every, len(self._ratio) // 8):
            self.refresh()

    def forget(self, row: int) -> None:
        """The row's engine left: its history goes with it (a new engine may reuse it)."""
        self._recent.pop(row, None)
        self._ratio.pop(row, None)
        self._changed.discard(row)
        if self._pace.pop(row, None) is not None:
            self._set_pace(row, 1.0)

    def refresh(self) -> None:
        """Recompute every row's pace against the fleet's median."""
        self._since_refresh = 0
        c = self.config
        for row in self._changed:
            recent = self._recent[row]
            if len(recent) >= c.min_samples:
                observed = math.fsum(o for o, _ in recent)
                estimated = math.fsum(e for _, e in recent)
                self._ratio[row] = math.log(observed / estimated)
        self._changed.clear()
        if len(self._ratio) < c.min_rows:
            return
        fleet = statistics.median(self._ratio.values())
        for row, ratio in self._ratio.items():
            rel = math.exp(ratio - fleet)
            was = self._pace.get(row)
            if rel >= c.on_ratio or (was is not None and rel >= c.off_ratio):
                pace = min(rel, c.max_pace)
                self._pace[row] = pace
                self._set_pace(row, pace)
            elif was is not None:
                del self._pace[row]
                self._set_pace(row, 1.0)
