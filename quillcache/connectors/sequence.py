"""Per-source sequence tracking, as pure logic (no sockets), so it can be property-tested.

A publisher numbers its batches 0, 1, 2, ... per process and rank. Two places see them:

- the receiver (`WireOrder`), in the publisher's own order. Only there does a seq that
  is not above the previous one mean something: the publisher started counting again
  (a restart). It counts such turns as *epochs* and tags every batch with its epoch.
- the applier (`SequenceTracker`), after the queue, interleaved with replays that may
  already have applied what is still queued. It classifies each batch:

  - RESTART: from a newer epoch than the one applied: a suspected restart, which the
    applier verifies on the engine's replay socket when there is one (a forged seq far
    ahead also turns the epoch once the real stream resumes below it);
  - DUPLICATE: same epoch, not above the last applied: a replay got there first. Never
    a restart: within one epoch the wire order was increasing;
  - APPLY: the next expected one;
  - GAP: later than expected: the batches in between must be replayed first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Verdict(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@dataclass
class WireOrder:
    """The receiver's view of one source: the last seq off the wire and its epoch."""

    last: int = -1
    epoch: int = 0

    def observe(self, seq: int) -> int:
        """The epoch of `seq`, received right after `last`."""
        if seq <= self.last:
            self.epoch += 1  # the publisher counts again: restarted (or `last` was forged)
        self.last = seq
        return self.epoch


@dataclass
class SequenceTracker:
    last: int = -1  # last applied seq; -1 = nothing applied yet (a fresh publisher starts at 0)
    epoch: int = 0  # the wire epoch the applied batches belong to
    last_digest: int | None = None  # of the batch `last`, when known: tells a restart apart

    def classify(self, seq: int, epoch: int) -> Verdict:
        if epoch > self.epoch:
            return Verdict.RESTART
        if seq <= self.last:
            return Verdict.DUPLICATE
        if seq == self.last + 1:
            return Verdict.APPLY
        return Verdict.GAP

    def applied(self, seq: int, digest: int | None = None) -> None:
        """`seq` is applied (in order: callers apply `last + 1` or after a checked gap)."""
        if seq > self.last:
            self.last = seq
            self.last_digest = digest

    def same_life(self, epoch: int) -> None:
        """A suspected restart was checked: the engine still holds `last` as applied."""
        self.epoch = max(self.epoch, epoch)

    def restarted(self, epoch: int | None = None) -> None:
        """A new publisher life (or a loss past repair): number from scratch."""
        self.last = -1
        self.last_digest = None
        if epoch is not None:
            self.epoch = max(self.epoch, epoch)
