"""The policy engine end to end: engine simulators and the gateway as processes, the
official `openai` client.

What must hold: a pin is placed on an engine when nobody holds it (a warm request with
the owner's salt), routing prefers its holders for the owner's requests (whatever the
router) and for nobody else's, a pinned prefix survives background traffic that evicts
everything else on a small engine (retention touches it), limits get a 4xx naming
them, the owner alone unpins, a dead engine fails only its own warm requests, and an
admin reset empties an engine's cache (vLLM's and SGLang's endpoints).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from quillcache.gateway.tenancy import hash_key
from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import wait_for

WARMS = "quillcache_policy_warm_requests_total"
BLOCK = 16  # the engine simulator's default block size; builtin tokenizer: a token per byte
KEYS = {"k-acme": "acme", "k-other": "other"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    yield from make_stack(tmp_path)


def config(**policy: object) -> dict[str, object]:
    return {
        "router": "round-robin",  # spreads everything: any stickiness is the pin's
        "api_keys": [{"sha256": hash_key(k), "tenant": t} for k, t in KEYS.items()],
        "policy": {"interval_s": 0.2, "touch_min_interval_s": 0.5, **policy},
    }


def text(tag: str, blocks: int) -> str:
    out = (f"{tag} " + "the policy engine keeps this prefix warm " * (blocks * 2))[: blocks * BLOCK]
    assert len(out.encode()) == blocks * BLOCK
    return out


SYSTEM = text("system", 20)


def pin(admin: httpx.Client, prompt: str, tenant: str = "acme", **extra: object) -> httpx.Response:
    return admin.post(
        "/admin/pins",
        json={"model": "sim-model", "prompt": prompt, **extra},
        headers={"x-tenant-id": tenant},
    )


def holders(admin: httpx.Client) -> dict[str, list[int]]:
    return {p["owner"]: p["holders"] for p in admin.get("/admin/pins").json()["pins"]}


def served_by(c: openai.OpenAI, prompt: str) -> tuple[int, int]:
    raw = c.completions.with_raw_response.create(model="sim-model", prompt=prompt, max_tokens=2)
    usage = raw.parse().usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    return int(raw.headers["x-quillcache-worker"]), cached


def test_pin_is_placed_preferred_for_its_tenant_and_unpinned_by_its_owner(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(config())
    admin = stack.admin()
    r = pin(admin, SYSTEM, ttl_s=600)
    assert r.status_code == 200, r.text
    assert r.json()["pinned"] == 20 and r.json()["ttl_s"] == 600
    # nobody held it: the policy engine places it (a prefetch with acme's salt)
    wait_for(lambda: holders(admin).get("acme"), what="the pin placed on an engine")
    (holder,) = holders(admin)["acme"]
    acme = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=0)
    other = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-other", max_retries=0)
    for i in range(6):
        worker, cached = served_by(acme, SYSTEM + f" turn {i} of acme's conversation")
        assert worker == holder
        assert cached >= 20 * BLOCK  # the prefetch filled acme's own namespace
    # another tenant's identical prompt is another namespace: no preference, no hit
    seen = {served_by(other, SYSTEM + f" turn {i} of another tenant")[0] for i in range(6)}
    assert seen == {0, 1}
    page = httpx.get(gw.url + "/metrics").text
    assert metric(page, WARMS + '{action="prefetch",outcome="ok"}') >= 1
    assert metric(page, 'quillcache_policy_prefill_tokens_total{action="prefetch"}') >= 20 * BLOCK
    # only its owner unpins it; then round-robin spreads acme's requests again
    wrong = admin.request(
        "DELETE", "/admin/pins", json={"model": "sim-model", "prompt": SYSTEM},
        headers={"x-tenant-id": "other"},
    )  # fmt: skip
    assert wrong.json() == {"unpinned": 0}  # another tenant's namespace: not its pin
    assert holders(admin)
    gone = admin.request(
        "DELETE", "/admin/pins", json={"model": "sim-model", "prompt": SYSTEM},
        headers={"x-tenant-id": "acme"},
    )  # fmt: skip
    assert gone.json() == {"unpinned": 20}
    assert holders(admin) == {}
    seen = {served_by(acme, SYSTEM + f" later turn {i}")[0] for i in range(6)}
    assert seen == {0, 1}


def test_pin_limits_get_a_4xx_naming_them(stack: Stack) -> None:
    stack.engine()
    stack.start_gateway(config(pin_budget_tokens=400, pin_max_ttl_s=3600))
    admin = stack.admin()
    for ttl, limit in [(86400 * 365, "policy.pin_max_ttl_s"), (-1, "policy.pin_max_ttl_s")]:
        r = pin(admin, SYSTEM, ttl_s=ttl)
        assert r.status_code == 400 and limit in r.json()["error"]["message"]
    r = pin(admin, SYSTEM, ttl_s="soon")
    assert r.status_code == 400 and "ttl_s" in r.json()["error"]["message"]
    assert pin(admin, SYSTEM).status_code == 200  # 320 tokens of a 400-token budget
    assert pin(admin, SYSTEM).status_code == 200  # the same pin again: no more tokens
    over = pin(admin, text("another", 10))
    assert over.status_code == 409
    assert "policy.pin_budget_tokens" in over.json()["error"]["message"]
    assert pin(admin, text("another", 10), tenant="other").status_code == 200  # its own budget
    short = pin(admin, "too short")
    assert short.status_code == 400 and "no whole block" in short.json()["error"]["message"]
    # a model no engine serves: nobody could hold the pin (it was kept for its TTL)
    nobody = pin(admin, SYSTEM, model="no-such-model")
    assert nobody.status_code == 404 and nobody.json()["error"]["code"] == "model_not_found"
    assert len(admin.get("/admin/pins").json()["pins"]) == 2


def test_retention_keeps_a_pinned_prefix_through_evicting_traffic(stack: Stack) -> None:
    """One small engine (64 blocks) and background traffic of 200 fresh blocks sent to
    it directly: an unpinned prefix placed before is evicted, the pinned one is kept."""
    engine = stack.engine(extra=["--num-gpu-blocks", "64"])
    stack.start_gateway(config(touch_safety=0.25))
    admin = stack.admin()
    assert pin(admin, SYSTEM).status_code == 200
    wait_for(lambda: holders(admin).get("acme") == [0], what="the pin placed")
    bystander = text("bystander", 20)

    def held(prompt: str) -> int:
        r = admin.post("/admin/lookup", json={"model": "sim-model", "prompt": prompt})
        return max((m["blocks"] for m in r.json()["matches"]), default=0)

    httpx.post(
        engine.url + "/v1/completions",
        json={"model": "sim-model", "prompt": bystander, "max_tokens": 1},
    ).raise_for_status()
    wait_for(lambda: held(bystander) == 20, what="the bystander cached")
    for i in range(25):  # ~8 fresh blocks a request, ~40 blocks a second
        httpx.post(
            engine.url + "/v1/completions",
            json={"model": "sim-model", "prompt": text(f"background {i:03d}", 8), "max_tokens": 1},
            timeout=10,
        ).raise_for_status()
        time.sleep(0.2)
    time.sleep(0.5)  # the last events
    assert held(bystander) < 20  # the LRU took (some of) what nobody touched
    assert holders(admin)["acme"] == [0]  # the pinned prefix is whole on its engine
    page = httpx.get(stack.gateway.url + "/metrics").text  # type: ignore[union-attr]
    assert metric(page, WARMS + '{action="retain",outcome="ok"}') >= 1
    # kept by touches, not placed again after each eviction
    assert metric(page, WARMS + '{action="prefetch",outcome="ok"}') == 1


def test_dead_engine_fails_its_warm_requests_without_blocking_routing(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(config(touch_max_interval_s=1.0))
    admin = stack.admin()
    assert pin(admin, SYSTEM).status_code == 200
    wait_for(lambda: holders(admin).get("acme"), what="the pin placed")
    (holder,) = holders(admin)["acme"]
    stack.engines[holder].kill()
    acme = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=1, timeout=20)
    # routing goes on (to the survivor), and the pin is placed there once the dead
    # engine is down and its residency gone
    for i in range(4):
        served_by(acme, SYSTEM + f" after the crash {i}")
    wait_for(
        lambda: holders(admin).get("acme") == [1 - holder], timeout=20, what="the pin re-placed"
    )


@pytest.mark.parametrize("flavor", ["vllm", "sglang"])
def test_admin_reset_empties_an_engine(stack: Stack, flavor: str) -> None:
    extra = ["--flavor", "sglang"] if flavor == "sglang" else []
    stack.engine(extra=extra)
    gw = stack.start_gateway({"router": "round-robin"})
    admin = stack.admin()
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0)
    c.completions.create(model="sim-model", prompt=SYSTEM, max_tokens=1)

    def held() -> int:
        r = admin.post("/admin/lookup", json={"model": "sim-model", "prompt": SYSTEM})
        return max((m["blocks"] for m in r.json()["matches"]), default=0)

    wait_for(lambda: held() == 20, what="the prompt cached")
    answers: list[httpx.Response] = []

    def reset() -> bool:
        # refused (409, the engine's reason) while a request runs there: the gateway's
        # own start-up checks may still be running one
        answers.append(admin.post("/admin/workers/0/reset_prefix_cache"))
        assert answers[-1].status_code in (200, 409), answers[-1].text
        return answers[-1].status_code == 200

    wait_for(reset, what="the reset accepted")
    r = answers[-1]
    assert r.json()["reset"] == ("/flush_cache" if flavor == "sglang" else "/reset_prefix_cache")
    wait_for(lambda: held() == 0, what="the index emptied by the engine's event")
    assert admin.post("/admin/workers/7/reset_prefix_cache").status_code == 404


def test_session_hint_keeps_the_next_turn_on_its_engine(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(config())
    acme = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=0)
    admin = stack.admin()

    def turn(history: str, **kw: object) -> tuple[int, int]:
        raw = acme.completions.with_raw_response.create(
            model="sim-model", prompt=history, max_tokens=2, **kw
        )
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return int(
            raw.headers["x-quillcache-worker"]
        ), usage.prompt_tokens_details.cached_tokens or 0

    forms: list[dict[str, object]] = [
        {"extra_headers": {"x-session-id": "s-header", "x-session-ttl-s": "60"}},
        {"extra_body": {"quillcache": {"session": {"id": "s-body", "ttl_s": 60}}}},
        {
            "extra_headers": {"x-session-id": "s-nvext"},
            "extra_body": {"nvext": {"cache_control": {"type": "ephemeral", "ttl": "1m"}}},
        },
    ]
    for n, form in enumerate(forms):
        history = text(f"session {n}", 12)
        first, _ = turn(history, **form)  # type: ignore[arg-type]
        for t in range(4):  # round-robin alone would alternate
            history += f" turn {t} " + "x" * 40
            worker, cached = turn(history, **form)  # type: ignore[arg-type]
            assert worker == first
            assert cached >= 12 * BLOCK
    sessions = {
        p["name"] for p in admin.get("/admin/pins").json()["pins"]
    }  # pins only: sessions are listed under /admin/sessions
    assert sessions == set()
    listed = admin.get("/admin/sessions").json()["sessions"]
    assert {s["name"] for s in listed} == {"s-header", "s-body", "s-nvext"}
    assert all(s["owner"] == "acme" and s["engine"] is not None for s in listed)
    # without a hint the same router spreads a conversation
    history = text("no hint", 12)
    seen = set()
    for t in range(4):
        history += f" turn {t} " + "y" * 40
        seen.add(turn(history)[0])
    assert seen == {0, 1}


BAD_HINTS: list[tuple[dict[str, str], dict[str, object], str]] = [
    ({"x-session-id": "s", "x-session-ttl-s": "99999999"}, {}, "policy.session_max_ttl_s"),
    ({"x-session-id": "s", "x-session-ttl-s": "-1"}, {}, "policy.session_max_ttl_s"),
    ({"x-session-id": "s", "x-session-ttl-s": "soon"}, {}, "x-session-ttl-s"),
    ({}, {"nvext": {"cache_control": {"type": "ephemeral", "ttl": "5x"}}}, "duration"),
    ({}, {"nvext": {"cache_control": {"type": "persistent"}}}, "ephemeral"),
    ({}, {"quillcache": {"session": {"id": "", "ttl_s": 5}}}, "quillcache.session.id"),
    ({}, {"quillcache": {"session": {"ttl_s": 5, "pin": True}}}, "quillcache.session"),
    ({"x-session-ttl-s": "30"}, {"quillcache": {"session": {"ttl_s": 60}}}, "different TTLs"),
    ({"x-session-id": "s"}, {"quillcache": {"session": {"id": "t", "ttl_s": 6}}}, "disagree"),
]


def test_bad_session_hints_get_a_400_naming_the_limit(stack: Stack) -> None:
    stack.engine()
    gw = stack.start_gateway(config())
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=0)
    for headers, body, names in BAD_HINTS:
        with pytest.raises(openai.BadRequestError) as bad:
            c.completions.create(
                model="sim-model",
                prompt=text("bad hint", 4),
                max_tokens=1,
                extra_headers=headers,
                extra_body=body,
            )
        assert names in bad.value.message, (headers, body)
    # a good hint on the same gateway is served
    c.completions.create(
        model="sim-model",
        prompt=text("good hint", 4),
        max_tokens=1,
        extra_headers={"x-session-id": "s", "x-session-ttl-s": "30"},
    )


def test_removing_a_session_s_engine_leaves_the_policy_working(stack: Stack) -> None:
    """A session bound to an engine that is then removed (`DELETE /admin/workers`): the
    policy loop drops the binding and goes on (a new pin is still placed), and no tick
    fails. Before, every tick raised for the unknown engine until the session expired."""
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(config())
    acme = openai.OpenAI(base_url=gw.url + "/v1", api_key="k-acme", max_retries=0)
    admin = stack.admin()
    raw = acme.completions.with_raw_response.create(
        model="sim-model",
        prompt=text("bound session", 12),
        max_tokens=2,
        extra_headers={"x-session-id": "s-gone", "x-session-ttl-s": "300"},
    )
    bound = int(raw.headers["x-quillcache-worker"])
    assert admin.delete(f"/admin/workers/{bound}").status_code == 200
    time.sleep(1.0)  # five policy ticks
    r = pin(admin, text("pinned after the removal", 8))
    assert r.status_code == 200
    wait_for(lambda: holders(admin).get("acme") == [1 - bound], 10.0, "the pin placed")
    failures = metric(
        httpx.get(gw.url + "/metrics").text, "quillcache_background_job_failures_total"
    )
    assert failures == 0
    (session,) = admin.get("/admin/sessions").json()["sessions"]
    assert session["name"] == "s-gone" and session["engine"] is None
