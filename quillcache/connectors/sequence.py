"""Per-source sequence tracking, as pure logic (no sockets), so it can be property-tested.

A publisher numbers its batches 0, 1, 2, ... per process and rank. The tracker
classifies each received seq:

- APPLY: the next expected one;
- GAP: later than expected, the batches in between must be replayed first;
- DUPLICATE: already applied (the live stream catching up after a replay);
- RESTART: lower than anything this publisher process could send again, i.e. the
  engine restarted and counts from 0.
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
class SequenceTracker:
    last: int = -1  # last applied seq; -1 = nothing applied yet (a fresh publisher starts at 0)
    # After a replay from `start`, the live stream may re-deliver start..last: those are
    # duplicates; anything below `start` is a new publisher process counting from 0.
    dup_floor: int | None = None

    def classify(self, seq: int) -> Verdict:
        if seq == self.last + 1:
            return Verdict.APPLY
        if seq > self.last:
            return Verdict.GAP
        if self.dup_floor is not None and seq >= self.dup_floor:
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def applied(self, seq: int) -> None:
        """Record that `seq` is applied; moving past the replayed range ends the duplicates."""
        if seq > self.last:
            self.last = seq
            self.dup_floor = None

    def replayed(self, start: int, last_replayed: int) -> None:
        """A replay from `start` applied everything up to `last_replayed` (-1: nothing)."""
        if last_replayed >= start:
            self.applied(last_replayed)
            self.dup_floor = start

    def restarted(self) -> None:
        self.last = -1
        self.dup_floor = None
