"""The gateway's request keys equal the normative reference (docs/content-key.md)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.hashing import reference
from quillcache.identity import content_keys, namespace


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.sampled_from([1, 4, 16, 32]),
    st.text(max_size=8),
    st.text(max_size=8),
)
def test_keys_match_the_reference(tokens: list[int], bs: int, model: str, tenant: str) -> None:
    ns = namespace(model, "", "", tenant, bs)
    assert ns == reference.namespace_id(model, "", "", tenant, bs)
    expected = reference.content_keys(tokens, bs, ns)
    assert content_keys(tokens, bs, ns).tolist() == expected
    assert content_keys(np.array(tokens, dtype=np.uint32), bs, ns).tolist() == expected


@pytest.mark.parametrize("bad", [[-1], [2**32]])
def test_out_of_range_tokens_are_rejected(bad: list[int]) -> None:
    with pytest.raises(ValueError, match="fit in 32 bits"):
        content_keys(bad * 16, 16, 1)
