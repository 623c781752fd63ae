"""Bad input to every gateway endpoint that takes a body: always a 2xx or a 4xx with
OpenAI's JSON error shape, never a 5xx (hypothesis against a live gateway process).

Bodies mix the fields the endpoints read (prompt, messages, model, worker, seq, ...)
with values of any JSON type, plus raw bytes that are not JSON at all. The engine runs
with `--time-scale 0` so that a body that happens to be valid is served at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.online.conftest import ADMIN, Stack

FIELDS = [
    "prompt",
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "stream_options",
    "cache_salt",
    "worker",
    "dp_rank",
    "seq",
    "batches",
    "draining",
    "url",
    "kv_endpoint",
    "dp_ranks",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.integers(min_value=2**32, max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(["sim-model", "nope", "user", "http://127.0.0.1:1", "tcp://x:1"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.sampled_from([*FIELDS, "role"]), inner)
    ),
    max_leaves=8,
)
bodies = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=5).map(
        lambda d: json.dumps(d).encode()
    ),
    st.binary(max_size=40),
    values.map(lambda v: json.dumps(v).encode()),
)
ENDPOINTS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/admin/lookup"),
    ("POST", "/admin/pins"),
    ("DELETE", "/admin/pins"),
    ("POST", "/admin/workers"),
    ("POST", "/admin/workers/0/drain"),
    ("POST", "/admin/workers/x/drain"),
    ("POST", "/ingest/kv_events"),
]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    s = Stack(tmp_path_factory.mktemp("bad-input"))
    try:
        s.engine(time_scale=0.0)
        gw = s.start_gateway({"max_body_bytes": 4096, "parity_check": False})
        headers = {"authorization": f"Bearer {ADMIN}"}
        with httpx.Client(base_url=gw.url, headers=headers, timeout=30) as client:
            yield client
    finally:
        s.kill_all()


def check(resp: httpx.Response) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:300])
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert "Traceback" not in resp.text


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies, as_msgpack=st.booleans())
def test_no_body_gets_a_server_error(
    gateway: httpx.Client, endpoint: tuple[str, str], body: bytes, as_msgpack: bool
) -> None:
    method, path = endpoint
    ctype = "application/msgpack" if as_msgpack else "application/json"
    check(gateway.request(method, path, content=body, headers={"content-type": ctype}))


@pytest.mark.parametrize(
    ("query", "body", "status"),
    [
        ("worker=0&seq=-1", msgpack.packb([1.0, [], 0]), 400),  # -1 is an internal marker
        ("worker=0&dp_rank=3", msgpack.packb([1.0, [], 0]), 400),
        ("worker=0&dp_rank=x", msgpack.packb([1.0, [], 0]), 400),
        ("worker=9", msgpack.packb([1.0, [], 0]), 404),
        ("worker=0&seq=0", msgpack.packb([1.0, [], 0]), 202),
    ],
)
def test_ingest_query_is_checked(
    gateway: httpx.Client, query: str, body: bytes, status: int
) -> None:
    resp = gateway.post(
        "/ingest/kv_events?" + query, content=body, headers={"content-type": "application/msgpack"}
    )
    assert resp.status_code == status, resp.text
    check(resp)


def test_drain_wants_a_boolean(gateway: httpx.Client) -> None:
    resp = gateway.post("/admin/workers/0/drain", json={"draining": "no"})
    assert resp.status_code == 400 and "true or false" in resp.json()["error"]["message"]
