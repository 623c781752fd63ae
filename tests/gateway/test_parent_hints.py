"""Parent hints (`quillcache.gateway.parent_hints`): clients' request ids mapped to the
gateway's, per namespace and bounded; over-long ids refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quillcache.gateway.httpio import ApiError
from quillcache.gateway.parent_hints import (
    CLIENT_ID_HEADER,
    MAX_ID_CHARS,
    PARENT_HEADER,
    ParentIds,
    check_parent_headers,
)


def test_a_tenant_cannot_name_another_tenant_s_request() -> None:
    ids = ParentIds()
    assert ids.resolve(1, {CLIENT_ID_HEADER: "plan"}, 10) is None
    assert ids.resolve(2, {PARENT_HEADER: "plan"}, 11) is None  # another namespace
    assert ids.resolve(1, {PARENT_HEADER: "plan"}, 12) == 10
    # an id sent again names its latest request
    ids.resolve(1, {CLIENT_ID_HEADER: "plan"}, 13)
    assert ids.resolve(1, {PARENT_HEADER: "plan"}, 14) == 13


@settings(max_examples=200)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 2), st.sampled_from(["", "a", "b", "c", "d", "e"]), st.booleans()),
        max_size=60,
    ),
    limit=st.integers(1, 4),
)
def test_resolve_matches_a_reference_of_the_latest_ids(
    ops: list[tuple[int, str, bool]], limit: int
) -> None:
    """Against a reference list of (namespace, id) -> request id, most recent last,
    cut to `limit`."""
    ids = ParentIds(limit)
    ref: list[tuple[tuple[int, str], int]] = []
    for rid, (ns, name, as_parent) in enumerate(ops):
        headers = {PARENT_HEADER: name} if as_parent else {CLIENT_ID_HEADER: name}
        want = None
        if as_parent and name:
            want = next((r for k, r in reversed(ref) if k == (ns, name)), None)
        assert ids.resolve(ns, headers, rid) == want
        if not as_parent and name:
            ref = [(k, r) for k, r in ref if k != (ns, name)] + [((ns, name), rid)]
            ref = ref[-limit:]
        assert len(ids) == len(ref)


def test_over_long_ids_are_refused_naming_the_header() -> None:
    check_parent_headers({CLIENT_ID_HEADER: "x" * MAX_ID_CHARS, PARENT_HEADER: "y"})
    for name in (CLIENT_ID_HEADER, PARENT_HEADER):
        with pytest.raises(ApiError) as bad:
            check_parent_headers({name: "x" * (MAX_ID_CHARS + 1)})
        assert bad.value.status == 400 and name in str(bad.value)
    with pytest.raises(ValueError):
        ParentIds(0)
