"""Property tests of the per-source sequence tracker against a model of a publisher."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quillcache.connectors.sequence import SequenceTracker, Verdict


@st.composite
def lossy_streams(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    """A publisher sends 0..n-1; the consumer receives an in-order subset; replays may run
    ahead of the live stream by any amount (the engine kept publishing meanwhile)."""
    n = draw(st.integers(1, 60))
    received = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
    ahead = draw(st.lists(st.integers(0, 5), min_size=len(received), max_size=len(received)))
    return n, received, ahead


@given(lossy_streams())
def test_gaps_then_replays_apply_every_seq_once_in_order(
    case: tuple[int, list[int], list[int]],
) -> None:
    n, received, ahead = case
    tracker = SequenceTracker()
    applied: list[int] = []
    for seq, extra in zip(received, ahead, strict=True):
        verdict = tracker.classify(seq)
        assert verdict is not Verdict.RESTART, (seq, tracker)
        if verdict is Verdict.GAP:
            start = tracker.last + 1
            end = min(n - 1, seq + extra)  # what the replay socket had by then
            applied.extend(range(start, end + 1))
            tracker.replayed({s: s for s in range(start, end + 1)})
            verdict = tracker.classify(seq)
        if verdict is Verdict.APPLY:
            applied.append(seq)
            tracker.applied(seq)
        else:
            assert verdict is Verdict.DUPLICATE
    assert applied == list(range(len(applied)))
    assert applied[-1] >= received[-1]


@given(st.integers(1, 50), st.integers(0, 49))
def test_a_lower_seq_outside_a_replay_is_a_restart(last: int, new: int) -> None:
    tracker = SequenceTracker()
    for seq in range(last + 1):
        assert tracker.classify(seq) is Verdict.APPLY
        tracker.applied(seq)
    expected = (
        Verdict.RESTART if new <= last else (Verdict.APPLY if new == last + 1 else Verdict.GAP)
    )
    assert tracker.classify(new) is expected


def test_duplicates_end_when_the_live_stream_passes_the_replay() -> None:
    tracker = SequenceTracker()
    tracker.applied(0)
    assert tracker.classify(5) is Verdict.GAP
    tracker.replayed({s: 100 + s for s in range(1, 9)})  # the replay ran ahead to 8
    assert [tracker.classify(s, 100 + s) for s in (5, 6, 7, 8)] == [Verdict.DUPLICATE] * 4
    # same seq, other bytes: a restarted engine, not a copy
    assert tracker.classify(6, 999) is Verdict.RESTART
    assert tracker.classify(9) is Verdict.APPLY
    tracker.applied(9)
    assert tracker.classify(3) is Verdict.RESTART  # no replay window any more
