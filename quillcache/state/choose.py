"""The booking rule, in Python: what the Lua booking script does in Redis, for the
local fallback (with the replica's last known loads) and for tests.

Among the shortlist (the router's order), in this order of precedence:

1. the session's bound engine, if it is in the shortlist and under its ceiling;
2. the candidate with the longest prefix being computed there now (a speculative
   placement of one of the request's anchors) that is under its ceiling raised by its
   credit for that prefix (`Candidate.credit` times the part of the request's
   `request_blocks` being computed), ties to the shortlist order;
3. the first candidate under its ceiling;
4. every candidate at or above its ceiling: the one with the least overshoot
   (load - ceiling), ties to the shortlist order.

"Under" is strict: load < ceiling. Overshoot, not a ratio, because a ceiling may be 0
(a candidate the router only wants when nothing else is free) and both are in the
same units.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from quillcache.state.types import ZERO_LOAD, Candidate, EngineKey, LoadWeights, SharedLoad


def choose(
    shortlist: Sequence[Candidate],
    loads: Mapping[EngineKey, SharedLoad],
    weights: LoadWeights,
    *,
    session_engine: EngineKey | None = None,
    pending_blocks: Mapping[EngineKey, int] | None = None,
    request_blocks: int = 0,
) -> tuple[int, str]:
    """(position in the shortlist, reason) of the candidate the booking step takes."""
    if not shortlist:
        raise ValueError("empty shortlist")
    scores = [weights.score(loads.get(c.engine, ZERO_LOAD)) for c in shortlist]
    under = [s < c.ceiling for s, c in zip(scores, shortlist, strict=True)]
    if session_engine is not None:
        for i, c in enumerate(shortlist):
            if c.engine == session_engine and under[i]:
                return i, "session"
    if pending_blocks:
        best, best_blocks = -1, 0
        for i, c in enumerate(shortlist):
            b = pending_blocks.get(c.engine, 0)
            if b <= best_blocks:
                continue
            credit = c.credit * min(b / request_blocks, 1.0) if request_blocks > 0 else 0.0
            if scores[i] < c.ceiling + credit:
                best, best_blocks = i, b
        if best >= 0:
            return best, "pending"
    for i, ok in enumerate(under):
        if ok:
            return i, "under"
    overs = [s - c.ceiling for s, c in zip(scores, shortlist, strict=True)]
    return overs.index(min(overs)), "over"
