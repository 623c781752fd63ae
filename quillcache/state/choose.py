"""The booking rule, in Python: what the Lua booking script does in Redis, for the
local fallback (with the replica's last known loads) and for tests.

The candidates are the shortlist (the router's order), then, given `OutsideTerms`, the
engines outside it that the shared state names for this request (`outsiders`): the
session's bound engine, then the engines computing a part of the request's prefix.
In this order of precedence:

1. the session's bound engine, if it is a candidate and under its ceiling;
2. the candidate with the longest prefix being computed there now (a speculative
   placement of one of the request's anchors) that is under its ceiling raised by its
   credit for that prefix (`Candidate.credit` times the part of the request's
   `request_blocks` being computed); among those computing the same depth, the first
   placed there (`Computing.rank`), then the candidates' order;
3. the first candidate of the shortlist under its ceiling;
4. every candidate of the shortlist at or above its ceiling: the one with the least
   overshoot (load - ceiling), ties to the shortlist order.

An engine outside the shortlist is taken only for what made it a candidate (steps 1
and 2): the router did not list it, so it is not a place for the request otherwise.

"Under" is strict: load < ceiling. Overshoot, not a ratio, because a ceiling may be 0
(a candidate the router only wants when nothing else is free) and both are in the
same units.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from quillcache.state.types import (
    ZERO_LOAD,
    Candidate,
    Computing,
    EngineKey,
    LoadWeights,
    OutsideTerms,
    SharedLoad,
)


def outsiders(
    shortlist: Sequence[Candidate],
    outside: OutsideTerms | None,
    *,
    session_engine: EngineKey | None = None,
    pending: Mapping[EngineKey, Computing] | None = None,
    draining: Collection[EngineKey] = (),
) -> list[Candidate]:
    """The candidates after the shortlist (none without `outside`): the session's bound
    engine if not listed, as a holder of the whole prefix (`outside.ceiling +
    outside.credit`), then the unlisted engines computing a part of the request's
    prefix by (engine, rank), each with `outside.ceiling` and `outside.credit`. A
    draining engine is none of them. Their `cached_blocks` is 0: the replica's view did
    not say what they hold."""
    if outside is None:
        return []
    listed = {c.engine for c in shortlist}
    out: list[Candidate] = []
    if session_engine is not None and session_engine not in listed | set(draining):
        out.append(Candidate(session_engine, outside.ceiling + outside.credit, 0.0, 0))
    computing = pending or {}
    for e in sorted(computing):
        if e in listed or e == session_engine or e in draining:
            continue
        if computing[e].blocks > 0:
            out.append(Candidate(e, outside.ceiling, outside.credit, 0))
    return out


def choose(
    shortlist: Sequence[Candidate],
    loads: Mapping[EngineKey, SharedLoad],
    weights: LoadWeights,
    *,
    session_engine: EngineKey | None = None,
    pending: Mapping[EngineKey, Computing] | None = None,
    request_blocks: int = 0,
    outside: OutsideTerms | None = None,
    draining: Collection[EngineKey] = (),
) -> tuple[int, str]:
    """(position, reason) of the candidate the booking step takes: a position in the
    shortlist, or `len(shortlist) + j` for the j-th of `outsiders(...)`."""
    if not shortlist:
        raise ValueError("empty shortlist")
    cands = [
        *shortlist,
        *outsiders(
            shortlist,
            outside,
            session_engine=session_engine,
            pending=pending,
            draining=draining,
        ),
    ]
    scores = [weights.score(loads.get(c.engine, ZERO_LOAD)) for c in cands]
    under = [s < c.ceiling for s, c in zip(scores, cands, strict=True)]
    if session_engine is not None:
        for i, c in enumerate(cands):
            if c.engine == session_engine and under[i]:
                return i, "session"
    if pending:
        # the deepest being computed, then the first placed there: the least (-blocks, rank)
        best, best_key = -1, (0, 0)
        for i, c in enumerate(cands):
            at = pending.get(c.engine)
            if at is None or at.blocks <= 0:
                continue
            key = (-at.blocks, at.rank)
            if best >= 0 and key >= best_key:
                continue
            part = min(at.blocks / request_blocks, 1.0) if request_blocks > 0 else 0.0
            if scores[i] < c.ceiling + c.credit * part:
                best, best_key = i, key
        if best >= 0:
            return best, "pending"
    n = len(shortlist)
    for i, ok in enumerate(under[:n]):
        if ok:
            return i, "under"
    overs = [s - c.ceiling for s, c in zip(scores[:n], shortlist, strict=True)]
    return overs.index(min(overs)), "over"
