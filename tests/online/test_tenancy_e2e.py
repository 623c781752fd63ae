"""The tenant boundary end to end: real gateway processes (both data paths), real engine
simulators, clients on two loopback addresses (127.0.0.2 is the trusted proxy).

What must hold: no request is ever matched (index) or served (the engine's
`usage.prompt_tokens_details.cached_tokens`) another namespace's blocks, whatever keys,
tenant headers and body salts it carries; a same-namespace repeat does hit (so a
missing field or a dead cache cannot make the test pass).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quillcache.gateway.tenancy import hash_key
from tests.online.conftest import Stack, make_stack
from tests.online.helpers import wait_for

BLOCK = 16
BLOCKS = 6
KEYS = {"k-acme": "acme", "k-mallory": "mallory", "k-shared": None}
TRUSTED = "127.0.0.2"
UNTRUSTED = "127.0.0.1"


def tenancy_config() -> dict[str, object]:
    return {
        "router": "quillcache",
        "api_keys": [
            {"sha256": hash_key(k), **({"tenant": t} if t else {})} for k, t in KEYS.items()
        ],
        "trusted_proxies": [TRUSTED],
    }


def prompt(tag: str) -> str:
    """`BLOCKS` full blocks (builtin tokenizer: a token per byte), distinct from the first
    byte on so that two tags never share a block."""
    text = (f"{tag} " + "a long shared system prompt " * 40)[: BLOCKS * BLOCK]
    assert len(text.encode()) == BLOCKS * BLOCK
    return text


def client(source: str) -> httpx.Client:
    return httpx.Client(
        timeout=20.0, transport=httpx.HTTPTransport(local_address=source, retries=0)
    )


@dataclasses.dataclass(frozen=True)
class Attempt:
    key: str | None
    tenant_header: str | None
    source: str
    salt: str | None


def send(c: httpx.Client, url: str, text: str, a: Attempt) -> httpx.Response:
    headers = {}
    if a.key is not None:
        headers["authorization"] = f"Bearer {a.key}"
    if a.tenant_header is not None:
        headers["x-tenant-id"] = a.tenant_header
    body: dict[str, object] = {"prompt": text, "max_tokens": 1}
    if a.salt is not None:
        body["cache_salt"] = a.salt
    return c.post(url + "/v1/completions", json=body, headers=headers)


def expected(a: Attempt) -> tuple[int, tuple[str, str] | None]:
    """The reference rule: the status, and the namespace (tenant, client salt) served."""
    if a.key not in KEYS:
        return 401, None
    key_tenant = KEYS[a.key]
    tenant = key_tenant or ""
    if a.tenant_header is not None and a.tenant_header != key_tenant:
        if a.source != TRUSTED or key_tenant is not None:
            return 403, None
        tenant = a.tenant_header
    return 200, (tenant, a.salt or "")


def cached(response: httpx.Response) -> int:
    usage = response.json()["usage"]
    assert "prompt_tokens_details" in usage, usage  # the field must be there to mean anything
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def lookup_blocks(stack: Stack, text: str, tenant: str, salt: str) -> int:
    body: dict[str, object] = {"prompt": text}
    if salt:
        body["cache_salt"] = salt
    headers = {"x-tenant-id": tenant} if tenant else {}
    matches = stack.admin().post("/admin/lookup", json=body, headers=headers).json()["matches"]
    return max((m["blocks"] for m in matches), default=0)


@pytest.fixture(scope="module", params=["native", "python"])
def tenant_stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir: Path = tmp_path_factory.mktemp(f"tenancy-{request.param}")
    for s in make_stack(workdir, relay=request.param):
        s.engine(time_scale=0.0)
        s.engine(time_scale=0.0)
        s.start_gateway(tenancy_config())
        yield s


def test_a_body_salt_naming_another_tenant_gets_nothing_of_its_cache(tenant_stack: Stack) -> None:
    """The reported leak: mallory sending `cache_salt: acme` (and the header) got 2,992 of
    3,000 prompt tokens from acme's cache."""
    gw = tenant_stack.gateway
    assert gw is not None
    text = prompt("secret-" + uuid.uuid4().hex[:8])
    with client(UNTRUSTED) as c:
        acme = Attempt("k-acme", None, UNTRUSTED, None)
        assert send(c, gw.url, text, acme).status_code == 200
        wait_for(lambda: lookup_blocks(tenant_stack, text, "acme", "") == BLOCKS, what="events")
        again = send(c, gw.url, text, acme)
        assert cached(again) == (BLOCKS - 1) * BLOCK  # vLLM never reuses the last block
        forged = send(c, gw.url, text, Attempt("k-mallory", "acme", UNTRUSTED, "acme"))
        assert forged.status_code == 403 and forged.json()["error"]["type"]
        salted = send(c, gw.url, text, Attempt("k-mallory", None, UNTRUSTED, "acme"))
        assert salted.status_code == 200 and cached(salted) == 0
        shared = send(c, gw.url, text, Attempt("k-shared", None, UNTRUSTED, "acme"))
        assert shared.status_code == 200 and cached(shared) == 0


def test_the_tenant_header_counts_only_from_the_trusted_proxy(tenant_stack: Stack) -> None:
    gw = tenant_stack.gateway
    assert gw is not None
    text = prompt("proxy-" + uuid.uuid4().hex[:8])
    with client(TRUSTED) as proxy, client(UNTRUSTED) as direct:
        via_proxy = Attempt("k-shared", "globex", TRUSTED, None)
        assert send(proxy, gw.url, text, via_proxy).status_code == 200
        wait_for(lambda: lookup_blocks(tenant_stack, text, "globex", "") == BLOCKS, what="events")
        assert cached(send(proxy, gw.url, text, via_proxy)) == (BLOCKS - 1) * BLOCK
        claimed = send(direct, gw.url, text, Attempt("k-shared", "globex", UNTRUSTED, None))
        assert claimed.status_code == 403
        assert "trusted proxy" in claimed.json()["error"]["message"]
        assert (
            send(direct, gw.url, text, Attempt("wrong", None, UNTRUSTED, None)).status_code == 401
        )


def test_a_client_cannot_pick_the_data_parallel_rank(tenant_stack: Stack) -> None:
    """The engine simulator answers 400 to a rank it does not have: a forwarded header
    would show."""
    gw = tenant_stack.gateway
    assert gw is not None
    with client(UNTRUSTED) as c:
        answer = c.post(
            gw.url + "/v1/completions",
            json={"prompt": prompt("rank"), "max_tokens": 1},
            headers={"authorization": "Bearer k-shared", "x-data-parallel-rank": "99"},
        )
    assert answer.status_code == 200, answer.text


attempts = st.builds(
    Attempt,
    key=st.sampled_from([*KEYS, None, "k-unknown"]),
    tenant_header=st.sampled_from([None, "acme", "mallory", "globex"]),
    source=st.sampled_from([TRUSTED, UNTRUSTED]),
    salt=st.sampled_from([None, "", "acme", "mallory", "s1"]),
)


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(seq=st.lists(st.tuples(attempts, st.integers(0, 1)), min_size=2, max_size=6))
def test_no_request_is_matched_or_served_another_namespaces_blocks(
    tenant_stack: Stack, seq: list[tuple[Attempt, int]]
) -> None:
    gw = tenant_stack.gateway
    assert gw is not None
    run = uuid.uuid4().hex[:8]
    texts = [prompt(f"p{i}-{run}") for i in range(2)]
    seen: set[tuple[tuple[str, str], int]] = set()  # (namespace, prompt) served so far
    clients = {TRUSTED: client(TRUSTED), UNTRUSTED: client(UNTRUSTED)}
    try:
        for attempt, which in seq:
            status, ns = expected(attempt)
            answer = send(clients[attempt.source], gw.url, texts[which], attempt)
            assert answer.status_code == status, (attempt, answer.text)
            if ns is None:
                continue
            hit = cached(answer)
            if (ns, which) not in seen:
                assert hit == 0, f"{attempt} was served {hit} tokens of another namespace"
            seen.add((ns, which))
            wait_for(
                lambda ns=ns, which=which: lookup_blocks(tenant_stack, texts[which], *ns) == BLOCKS,
                what="its blocks in its own namespace",
            )
            # the index: every namespace that never sent this prompt matches none of it
            for other in {("acme", ""), ("mallory", ""), ("", ""), ("", "acme"), ("globex", "")}:
                if (other, which) not in seen:
                    assert lookup_blocks(tenant_stack, texts[which], *other) == 0, other
            # and a same-namespace repeat hits (the field and the cache are live)
            assert cached(send(clients[attempt.source], gw.url, texts[which], attempt)) > 0
    finally:
        for c in clients.values():
            c.close()


def test_the_secret_survives_a_restart_so_tenants_keep_their_cache(stack: Stack) -> None:
    stack.engine(time_scale=0.0)
    gw = stack.start_gateway(tenancy_config())
    text = prompt("restart-" + uuid.uuid4().hex[:8])
    acme = Attempt("k-acme", None, UNTRUSTED, None)
    with client(UNTRUSTED) as c:
        assert send(c, gw.url, text, acme).status_code == 200
        gw.kill()
        gw = stack.start_gateway(tenancy_config())
        assert cached(send(c, gw.url, text, acme)) == (BLOCKS - 1) * BLOCK


def test_without_tenants_the_gateway_says_the_cache_is_shared(stack: Stack) -> None:
    stack.engine(time_scale=0.0)
    gw = stack.start_gateway({})
    wait_for(lambda: "share one cache namespace" in gw.log_path.read_text(), what="notice")
    isolated = stack.start_gateway(tenancy_config())
    assert "share one cache namespace" not in isolated.log_path.read_text()
