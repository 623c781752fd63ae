"""Per-source sequence tracking, as pure logic (no sockets), so it can be property-tested.

A publisher numbers its batches 0, 1, 2, ... per process and rank. The tracker
classifies each received seq:

- APPLY: the next expected one;
- GAP: later than expected, the batches in between must be replayed first;
- DUPLICATE: already applied through a replay (the live stream catching up);
- RESTART: not later than the last applied and not a copy of a replayed batch: a new
  publisher process counting from 0 again.

A replayed batch is remembered by a digest of its payload until the live stream moves
past the replayed range, so "the same seq again" is told apart exactly: same bytes is
a duplicate, other bytes is a restarted engine.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Verdict(enum.Enum):
    APPLY = "apply"
    GAP = "gap"
    DUPLICATE = "duplicate"
    RESTART = "restart"


@dataclass
class SequenceTracker:
    last: int = -1  # last applied seq; -1 = nothing applied yet (a fresh publisher starts at 0)
    replayed_digests: dict[int, int] = field(default_factory=dict)  # seq -> payload digest
    last_digest: int | None = None  # of the batch `last`, when known: tells a restart apart

    def classify(self, seq: int, digest: int | None = None) -> Verdict:
        if seq == self.last + 1:
            return Verdict.APPLY
        if seq > self.last:
            return Verdict.GAP
        known = self.replayed_digests.get(seq)
        if known is not None and (digest is None or digest == known):
            return Verdict.DUPLICATE
        return Verdict.RESTART

    def applied(self, seq: int, digest: int | None = None) -> None:
        """Record that `seq` is applied; moving past the replayed range ends the duplicates."""
        if seq > self.last:
            self.last = seq
            self.last_digest = digest
            self.replayed_digests.clear()

    def replayed(self, digests: dict[int, int]) -> None:
        """A replay applied these contiguous batches (seq -> payload digest)."""
        if digests:
            top = max(digests)
            self.applied(top, digests[top])
            self.replayed_digests = dict(digests)

    def restarted(self) -> None:
        self.last = -1
        self.last_digest = None
        self.replayed_digests.clear()
