"""`ApplyStats +=` sums every counter (its fields written out by hand: a field added
without its line would be silently dropped)."""

from __future__ import annotations

import dataclasses

from hypothesis import given
from hypothesis import strategies as st

from quillcache.index import ApplyStats

counts = st.integers(0, 2**40)
stats = st.builds(ApplyStats, *([counts] * len(dataclasses.fields(ApplyStats))))


@given(a=stats, b=stats)
def test_every_field_is_summed(a: ApplyStats, b: ApplyStats) -> None:
    want = {f.name: getattr(a, f.name) + getattr(b, f.name) for f in dataclasses.fields(a)}
    a += b
    assert dataclasses.asdict(a) == want
