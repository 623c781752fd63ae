"""`first_min` is the position of the smallest row by its keys, the first among equals,
whichever path it takes (a Python loop for a few rows, numpy for more)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.routing.base import first_min

values = st.sampled_from([0.0, -0.0, 1.0, 2.5, 3.0, 1e300])


@settings(max_examples=400)
@given(
    rows=st.integers(1, 40),
    data=st.data(),
)
def test_first_min_is_the_first_smallest_tuple(rows: int, data: st.DataObject) -> None:
    loads = np.asarray(data.draw(st.lists(values, min_size=rows, max_size=rows)))
    queued = np.asarray(data.draw(st.lists(values, min_size=rows, max_size=rows)))
    ids = np.asarray(
        data.draw(st.lists(st.integers(0, 3), min_size=rows, max_size=rows)), dtype=np.uint64
    )
    keys = (loads, queued, ids)[: data.draw(st.integers(1, 3))]
    want = min(range(rows), key=lambda i: tuple(k[i] for k in keys))
    assert first_min(*keys) == want
