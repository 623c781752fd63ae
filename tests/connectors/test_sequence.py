"""Property tests of the per-source sequence rules (receiver epochs, applier verdicts)
against a reference model of a publisher, a lossy queue and replays that run ahead."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from quillcache.connectors.sequence import SequenceTracker, Verdict, WireOrder


@st.composite
def publisher_lives(draw: st.DrawFn) -> list[list[int]]:
    """Per life of the publisher, the seqs (0..n-1) that reach the receiver, in order.

    A new life shows on the wire only if its first seq received is not above the last
    one of the life before (otherwise the reconnect's restart probe finds it: not
    modelled here), so every later life starts at or below that."""
    lives = draw(st.integers(1, 4))
    out: list[list[int]] = []
    for _ in range(lives):
        n = draw(st.integers(1, 40))
        seqs = sorted(draw(st.sets(st.integers(0, n - 1), min_size=1)))
        if out and seqs[0] > out[-1][-1]:
            seqs = sorted({out[-1][-1], *seqs})
        out.append(seqs)
    return out


@given(publisher_lives(), st.data())
def test_queued_batches_behind_a_replay_are_duplicates_never_restarts(
    lives: list[list[int]], data: st.DataObject
) -> None:
    """The applier runs any amount behind the receiver, and replays (gap fills, quiet
    checks) run ahead of what is queued, up to what the publisher has sent. Reference:
    within a life every seq up to the last received is applied exactly once, in order;
    a restart verdict comes exactly once per new life that reaches the receiver."""
    wire = WireOrder()
    tracker = SequenceTracker()
    queued: list[tuple[int, int, int]] = []  # (life, epoch, seq)
    for life, seqs in enumerate(lives):
        for seq in seqs:
            queued.append((life, wire.observe(seq), seq))
    sent_top = {life: max(seqs) for life, seqs in enumerate(lives)}
    applied: dict[int, list[int]] = {}
    life_applied = -1  # the life whose batches the tracker holds
    restarts = 0
    for life, epoch, seq in queued:
        if life == life_applied and tracker.last < sent_top[life] and data.draw(st.booleans()):
            # a replay to the end ran ahead of this queued batch (a quiet-tail check)
            ahead = data.draw(st.integers(tracker.last + 1, sent_top[life]))
            applied[life].extend(range(tracker.last + 1, ahead + 1))
            tracker.applied(ahead)
        verdict = tracker.classify(seq, epoch)
        if verdict is Verdict.RESTART:
            # the applier verifies on the replay socket: another life never holds `last`
            # with the same bytes
            assert life != life_applied
            restarts += 1
            tracker.restarted(epoch)
            life_applied = life
            applied[life] = []
            verdict = tracker.classify(seq, epoch)
        if life_applied == -1:
            life_applied = life
            applied[life] = []
        assert life == life_applied
        if verdict is Verdict.GAP:
            applied[life].extend(range(tracker.last + 1, seq))  # replay [last+1, seq-1]
            tracker.applied(seq - 1)
            verdict = tracker.classify(seq, epoch)
        if verdict is Verdict.APPLY:
            applied[life].append(seq)
            tracker.applied(seq)
        else:
            assert verdict is Verdict.DUPLICATE
    assert restarts == len(lives) - 1
    for life, seqs in applied.items():
        assert seqs == list(range(len(seqs)))
        assert seqs[-1] >= max(lives[life])


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=50))
def test_the_wire_epoch_turns_exactly_when_the_seq_does_not_rise(seqs: list[int]) -> None:
    wire = WireOrder()
    epochs = [wire.observe(s) for s in seqs]
    expected, epoch, last = [], 0, -1
    for s in seqs:
        epoch += s <= last
        expected.append(epoch)
        last = s
    assert epochs == expected


@given(st.integers(0, 30), st.integers(10**6, 2**63))
def test_a_forged_seq_far_ahead_turns_the_epoch_once_and_is_verified_back(
    last: int, forged: int
) -> None:
    """The forged frame is a gap the replay cannot fill (dropped by the applier); the real
    stream below it turns the wire's epoch: a suspected restart, which the replay socket
    disproves, after which the stream applies as before."""
    wire, tracker = WireOrder(), SequenceTracker()
    for seq in range(last + 1):
        assert tracker.classify(seq, wire.observe(seq)) is Verdict.APPLY
        tracker.applied(seq)
    assert tracker.classify(forged, wire.observe(forged)) is Verdict.GAP
    epoch = wire.observe(last + 1)
    assert tracker.classify(last + 1, epoch) is Verdict.RESTART
    tracker.same_life(epoch)  # the engine still holds `last` with the same bytes
    assert tracker.classify(last + 1, epoch) is Verdict.APPLY
    tracker.applied(last + 1)
    assert tracker.classify(last + 2, wire.observe(last + 2)) is Verdict.APPLY


@given(st.integers(0, 50), st.integers(0, 50))
def test_within_an_epoch_nothing_is_a_restart(last: int, seq: int) -> None:
    tracker = SequenceTracker()
    tracker.applied(last)
    expected = (
        Verdict.DUPLICATE if seq <= last else Verdict.APPLY if seq == last + 1 else Verdict.GAP
    )
    assert tracker.classify(seq, 0) is expected
    assert tracker.classify(seq, 1) is Verdict.RESTART
