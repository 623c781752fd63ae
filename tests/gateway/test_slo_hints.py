"""SLO hints (quillcache/gateway/slo.py): their limits, and what the trust policy lets
them do, against a reference written from the documented rules."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from quillcache.controlplane.admission import effective_slo
from quillcache.gateway.httpio import ApiError
from quillcache.gateway.slo import SloPolicy, read_hints, read_priority
from quillcache.routing import SLO, Request

LIMIT_MS = 600_000.0
bounds = st.one_of(st.none(), st.floats(0.001, 600.0))
slos = st.builds(SLO, ttft_s=bounds, tbt_s=bounds)
hints = st.one_of(st.none(), slos)


@given(
    ttft=st.one_of(
        st.none(),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=6),
        st.sampled_from(["1_000", "0x10", " 250 ", "1e3", "nan", "inf", "+5", ".5", "5."]),
    ),
)
def test_header_values_are_checked_against_the_limit(ttft: object) -> None:
    headers = {} if ttft is None else {"x-slo-ttft-ms": str(ttft)}
    text = str(ttft).strip()
    try:
        # a decimal number only: digits, a point, a sign and an exponent
        decimal = bool(text) and set(text) <= set("0123456789.+-eE")
        number = (float(text) if decimal else math.nan) if ttft is not None else None
    except ValueError:
        number = math.nan
    valid = number is None or (math.isfinite(number) and 0 < number <= LIMIT_MS)
    if valid:
        slo = read_hints(headers, {}, LIMIT_MS)
        assert (slo is None) == (number is None)
        if slo is not None and number is not None:
            assert slo.ttft_s == number / 1000 and slo.tbt_s is None
    else:
        with pytest.raises(ApiError) as refused:
            read_hints(headers, {}, LIMIT_MS)
        assert refused.value.status == 400 and "600000" in refused.value.message
        assert refused.value.param == "x-slo-ttft-ms"


@given(value=st.one_of(st.booleans(), st.text(max_size=4), st.floats(), st.integers()))
def test_body_values_must_be_json_numbers_within_the_limit(value: object) -> None:
    body: dict[str, object] = {"prompt": "x", "quillcache": {"slo": {"tbt_ms": value}}}
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 < value <= LIMIT_MS
    )
    if ok:
        slo = read_hints({}, body, LIMIT_MS)
        assert slo == SLO(ttft_s=None, tbt_s=float(value) / 1000)  # type: ignore[arg-type]
        assert "quillcache" not in body  # not forwarded
    else:
        with pytest.raises(ApiError) as refused:
            read_hints({}, body, LIMIT_MS)
        assert refused.value.param == "quillcache.slo.tbt_ms"


def _reference(hint: SLO | None, default: SLO | None, mode: str, trusted: bool) -> SLO | None:
    """The admission bounds (own, else default) the documented policy gives."""
    own = None if hint is None or mode == "ignore" else hint
    d = default or SLO()
    if own is None:
        return default
    out = []
    for h, dv in ((own.ttft_s, d.ttft_s), (own.tbt_s, d.tbt_s)):
        if h is None:
            out.append(dv)
        elif mode == "honour" or trusted or dv is None:
            out.append(h)
        else:
            out.append(min(h, dv))
    return SLO(*out)


@given(
    hint=hints,
    default=st.one_of(st.none(), slos),
    mode=st.sampled_from(["tighten", "honour", "ignore"]),
    trusted=st.booleans(),
)
def test_policy_matches_the_documented_rules(
    hint: SLO | None, default: SLO | None, mode: str, trusted: bool
) -> None:
    policy = SloPolicy(mode, frozenset({"gold"}), default, LIMIT_MS)
    own = policy.apply(hint, "gold" if trusted else "basic")
    request = Request(1, np.zeros(0, dtype=np.uint64), 1, slo=own)
    got = effective_slo(request, default)
    assert got == _reference(hint, default, mode, trusted)
    if mode == "tighten" and not trusted and default is not None and got is not None:
        # an untrusted hint never loosens a default bound
        for g, dv in ((got.ttft_s, default.ttft_s), (got.tbt_s, default.tbt_s)):
            if dv is not None:
                assert g is not None and g <= dv


@given(value=st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=3)))
def test_priority_is_a_32_bit_integer(value: object) -> None:
    body: dict[str, object] = {} if value is None else {"priority": value}
    ok = value is None or (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**31
    )
    if ok:
        assert read_priority(body) == (value or 0)
    else:
        with pytest.raises(ApiError) as refused:
            read_priority(body)
        assert refused.value.status == 400 and "2**31" in refused.value.message


@given(priority=st.integers(-(2**31) + 1, 2**31 - 1), trusted=st.booleans())
def test_untrusted_priority_never_goes_ahead_of_the_default(priority: int, trusted: bool) -> None:
    policy = SloPolicy("tighten", frozenset({"gold"}), None, LIMIT_MS)
    got = policy.priority(priority, "gold" if trusted else "basic")
    assert got == (priority if trusted else max(priority, 0))
    assert SloPolicy("ignore", frozenset(), None, LIMIT_MS).priority(priority, "x") == 0
    assert SloPolicy("honour", frozenset(), None, LIMIT_MS).priority(priority, "x") == priority


@pytest.mark.parametrize(
    ("ext", "code", "named"),
    [
        ({"bogus": 1}, "invalid_extension", "['bogus']"),
        ([1], "invalid_extension", "got list"),
        ({"slo": 5}, "invalid_slo", "'quillcache.slo' must be an object"),
    ],
)
def test_the_extension_names_what_it_takes(ext: object, code: str, named: str) -> None:
    """The body's `quillcache` object takes `slo` and `session` (the session hint's
    reader takes its field first): an error names both, not `slo` alone."""
    with pytest.raises(ApiError) as refused:
        read_hints({}, {"prompt": "x", "quillcache": ext}, LIMIT_MS)
    assert refused.value.status == 400
    assert refused.value.code == code
    assert named in refused.value.message
    if code == "invalid_extension":
        assert "'slo' and 'session'" in refused.value.message
