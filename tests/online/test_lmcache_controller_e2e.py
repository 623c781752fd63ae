"""LMCache's controller as the policy engine's actuator, end to end: two simulated vLLM
engines with in-process LMCache and LMCache's controller API (`engine-sim --engines 2
--lmcache vllm --lmcache-controller`), the gateway as a process with the controller
attached by its configuration (`policy.lmcache`), the official `openai` client.

A burst of one prompt queues on the engine holding it (two sequence slots each, SGLang's
cache-aware router) while the other idles; the holder's LMCache has the prompt in its
CPU tier (its events say so). The replica is then copied with LMCache's `/move`
(`should_copy`) instead of being recomputed: the warm request that follows loads it on
the idle engine, which computes at most one block of it. When the controller cannot
move it, the warm request recomputes it, as without LMCache. LMCache's `/clear` is an
admin action beside the engine reset.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from quillcache.up import Proc, engine_args, launch
from tests.online.conftest import ADMIN, metric
from tests.online.helpers import free_port, wait_for

BLOCK = 16  # the engine simulator's block size; builtin tokenizer: a token per byte
CHUNK = 256  # LMCache's chunk size, the one its controller's /lookup hashes with
SYSTEM_BLOCKS = 48  # three LMCache chunks
WARMS = "quillcache_policy_warm_requests_total"
MOVES = "quillcache_policy_lmcache_moves_total"
CPU = "LocalCPUBackend"
REPLICATE_OK = '{action="replicate",outcome="ok"}'
REPLICATE_PREFILL = 'quillcache_policy_prefill_tokens_total{action="replicate"}'


def text(tag: str, blocks: int) -> str:
    out = (f"{tag} " + "a popular system prompt that every request starts with " * blocks)[
        : blocks * BLOCK
    ]
    assert len(out.encode()) == blocks * BLOCK
    return out


SYSTEM = text("system", SYSTEM_BLOCKS)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Proc]:
    extra = [
        "--engines", "2",
        "--max-num-seqs", "2",
        "--lmcache", "vllm",
        "--lmcache-chunk-size", str(CHUNK),
        "--lmcache-controller",
    ]  # fmt: skip
    proc = launch("engines", engine_args(extra=extra), tmp_path)
    try:
        yield proc
    finally:
        proc.kill()


def gateway(
    tmp_path: Path,
    engines: Proc,
    *,
    controller: str | None = None,
    mapped: int = 2,
    policy: dict[str, Any] | None = None,
    api_keys: list[dict[str, str]] | None = None,
) -> Proc:
    """The gateway over both engines, replication on, LMCache's controller attached
    (`controller`: another URL, e.g. a dead one); `mapped`: engines named as instances;
    `policy`: more policy settings."""
    urls = [e["url"] for e in engines.ready["engines"]]
    config = {
        "admin_token": ADMIN,
        "tokenizer": "builtin",
        "relay": "python",
        "router": "sglang",
        "secret_file": str(tmp_path / "gateway-secret.json"),
        "workers": [{"url": u} for u in urls],
        "api_keys": api_keys or [],
        "policy": {
            "interval_s": 0.1,
            "replication": {"enabled": True, "min_rate": 0.5, "min_blocks": 4, "cooldown_s": 0.5},
            **(policy or {}),
        },
    }
    settings = {
        "controller": controller or engines.ready["lmcache_controller"],
        "instances": {
            e["url"]: e["lmcache_instance_id"] for e in engines.ready["engines"][:mapped]
        },
        "timeout_s": 5,
    }
    config["policy"]["lmcache"] = settings
    (tmp_path / "gw.json").write_text(json.dumps(config))
    args = ["gateway", "--port", "0", "--config", str(tmp_path / "gw.json")]
    proc = launch("gateway", args, tmp_path)
    _GATEWAYS.append(proc)
    return proc


#: The gateways a test started: killed when it ends (`_kill_gateways`).
_GATEWAYS: list[Proc] = []


@pytest.fixture(autouse=True)
def _kill_gateways() -> Iterator[None]:
    yield
    while _GATEWAYS:
        _GATEWAYS.pop().kill()


def served_by(c: openai.OpenAI, prompt: str, max_tokens: int = 24) -> tuple[int, int]:
    raw = c.completions.with_raw_response.create(
        model="sim-model", prompt=prompt, max_tokens=max_tokens
    )
    usage = raw.parse().usage
    assert usage is not None
    details = usage.prompt_tokens_details
    cached = details.cached_tokens if details is not None and details.cached_tokens else 0
    return int(raw.headers["x-quillcache-worker"]), cached


def admin(gw: Proc) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=10, headers={"authorization": f"Bearer {ADMIN}"})


def held(gw: Proc, prompt: str) -> dict[tuple[int, str], int]:
    """(worker, medium) -> blocks of `prompt` the gateway's index says it holds."""
    with admin(gw) as a:
        r = a.post("/admin/lookup", json={"model": "sim-model", "prompt": prompt})
    assert r.status_code == 200, r.text
    return {(m["worker"], m["medium"].lower()): m["blocks"] for m in r.json()["matches"]}


def burst(gw: Proc, api_key: str = "unused") -> tuple[list[tuple[int, int]], str, int]:
    """The served (worker, cached tokens) of a burst on one hot prefix, the gateway's
    metrics, and the engine that held the prefix first (its GPU and LMCache; LMCache's
    chunks, salt-less, are indexed in the namespace without a salt)."""
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=api_key, max_retries=0)
    holder, _ = served_by(client, SYSTEM + " the first request", max_tokens=1)
    wait_for(
        lambda: held(gw, SYSTEM).get((holder, "cpu"), 0) >= SYSTEM_BLOCKS,
        what="the holder's LMCache chunks in the gateway's index",
    )
    with ThreadPoolExecutor(16) as pool:
        out = list(
            pool.map(
                lambda i: served_by(client, SYSTEM + f" request {i} " + text(f"q{i}", 8)),
                range(64),
            )
        )
    return out, httpx.get(gw.url + "/metrics").text, holder


def summary(page: str, served: list[tuple[int, int]], idle: int) -> str:
    """What a burst's replica cost and gave (printed with -s; docs/results/policy.md)."""
    rep = [cached for worker, cached in served if worker == idle]
    moves = {o: metric(page, MOVES + f'{{outcome="{o}"}}') for o in ("ok", "failed")}
    moved = metric(page, "quillcache_policy_lmcache_moved_tokens_total")
    replicas = metric(page, WARMS + REPLICATE_OK)
    prefill = metric(page, REPLICATE_PREFILL)
    return (
        f"moves {moves}, moved tokens {moved:g}, replicate ok {replicas:g}, its prefill "
        f"tokens {prefill:g}; {len(rep)} requests served on the replica, best cached "
        f"{max(rep, default=0)}"
    )


def controller_post(engines: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engines.ready["lmcache_controller"] + path, json=body, timeout=10)


def test_a_hot_prefix_offloaded_in_lmcache_is_moved_not_recomputed(
    tmp_path: Path, engines: Proc
) -> None:
    gw = gateway(tmp_path, engines)
    served, page, holder = burst(gw)
    idle = 1 - holder
    print(summary(page, served, idle))
    assert metric(page, MOVES + '{outcome="ok"}') == 1
    assert metric(page, MOVES) == 1  # idempotent: one move, then the index shows the replica
    assert metric(page, "quillcache_policy_lmcache_moved_tokens_total") == SYSTEM_BLOCKS * BLOCK
    assert metric(page, WARMS + REPLICATE_OK) == 1
    # the replica's warm request loaded the moved chunks: vLLM computes at least the
    # prompt's last token, nothing else of the prefix
    assert metric(page, REPLICATE_PREFILL) <= BLOCK
    calls = 'quillcache_lmcache_controller_calls_total{call="%s",result="%s"}'
    assert metric(page, calls % ("lookup", "ok")) == 1
    assert metric(page, calls % ("move", "ok")) == 1
    assert metric(page, calls % ("check_finish", "error")) == 1  # 0.5.6: not implemented
    # the idle engine now holds it on its GPU (its own events), and serves hits from it
    assert held(gw, SYSTEM).get((idle, "gpu"), 0) >= SYSTEM_BLOCKS
    on_replica = [cached for worker, cached in served if worker == idle]
    assert on_replica and max(on_replica) >= (SYSTEM_BLOCKS - 1) * BLOCK
    # LMCache's controller still names the holder only (the first registered instance
    # holding each chunk), and /move left the holder's chunks pinned: /clear keeps them
    tokens = list(SYSTEM.encode())
    found = controller_post(engines, "/lookup", {"tokens": tokens}).json()["layout_info"]
    assert found == {f"lmcache-instance-{holder}": [CPU, SYSTEM_BLOCKS * BLOCK]}
    with admin(gw) as a:
        cleared = a.post(f"/admin/workers/{holder}/reset_prefix_cache?tier=lmcache")
        assert cleared.status_code == 200, cleared.text
        assert cleared.json()["lmcache_instance"] == f"lmcache-instance-{holder}"
        again = controller_post(engines, "/lookup", {"tokens": tokens}).json()["layout_info"]
        assert again == found  # pinned by the move: LMCache 0.5.6 has no unpin
        # the idle engine's copy is not pinned: its /clear drops it
        drop = a.post(f"/admin/workers/{idle}/reset_prefix_cache?tier=lmcache")
        assert drop.status_code == 200 and drop.json()["tokens"] >= SYSTEM_BLOCKS * BLOCK


def test_a_salted_tenants_offloaded_prefix_is_moved_too(tmp_path: Path, engines: Proc) -> None:
    """In-process LMCache keys chunks by tokens alone and its events name no salt: the
    policy engine looks for a salted tenant's prefix in LMCache under the keys without
    the salt, and the replica it loads lands in the tenant's own namespace."""
    gw = gateway(tmp_path, engines, api_keys=[{"key": "k-acme", "tenant": "acme"}])
    served, page, holder = burst(gw, api_key="k-acme")
    idle = 1 - holder
    print(summary(page, served, idle))
    assert metric(page, MOVES + '{outcome="ok"}') == 1
    assert metric(page, REPLICATE_PREFILL) <= BLOCK
    on_replica = [cached for worker, cached in served if worker == idle]
    assert on_replica and max(on_replica) >= (SYSTEM_BLOCKS - 1) * BLOCK
    # the replica is acme's: the index shows it on the idle engine in acme's namespace only
    with admin(gw) as a:
        body = {"model": "sim-model", "prompt": SYSTEM}
        acme = a.post("/admin/lookup", json=body, headers={"x-tenant-id": "acme"}).json()
    gpu = {m["worker"]: m["blocks"] for m in acme["matches"] if m["medium"] == "GPU"}
    assert gpu.get(idle, 0) >= SYSTEM_BLOCKS
    assert held(gw, SYSTEM).get((idle, "gpu"), 0) == 0


def test_a_move_that_fails_falls_back_to_recomputing(tmp_path: Path, engines: Proc) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    gw = gateway(tmp_path, engines, controller=dead)
    served, page, holder = burst(gw)
    idle = 1 - holder
    print(summary(page, served, idle))
    assert metric(page, MOVES + '{outcome="failed"}') >= 1
    assert metric(page, MOVES + '{outcome="ok"}') == 0
    assert metric(page, WARMS + REPLICATE_OK) == 1
    # recomputed: the whole prefix but the last token's block at least
    assert metric(page, REPLICATE_PREFILL) >= ((SYSTEM_BLOCKS - 1) * BLOCK)
    on_replica = [cached for worker, cached in served if worker == idle]
    assert on_replica and max(on_replica) >= (SYSTEM_BLOCKS - 1) * BLOCK


@pytest.mark.parametrize("controller_up", [True, False])
def test_a_move_spends_the_replicas_budget_only_for_what_it_did_not_move(
    tmp_path: Path, engines: Proc, controller_up: bool
) -> None:
    """A budget of 40 prefill tokens an engine (5 a second, 8 s of burst): a moved replica
    costs the one token vLLM computes and is sent; when the move fails, recomputing the
    768 tokens is over the budget and the replica is skipped."""
    dead = None if controller_up else f"http://127.0.0.1:{free_port()}"
    gw = gateway(tmp_path, engines, controller=dead, policy={"engine_tokens_per_s": 5.0})
    served, page, holder = burst(gw)
    print(summary(page, served, 1 - holder))
    if controller_up:
        assert metric(page, MOVES + '{outcome="ok"}') == 1
        assert metric(page, WARMS + REPLICATE_OK) == 1
        assert metric(page, REPLICATE_PREFILL) <= 1
    else:
        assert metric(page, MOVES + '{outcome="failed"}') >= 1
        assert metric(page, WARMS + REPLICATE_OK) == 0
        assert metric(page, WARMS + '{action="replicate",outcome="budget"}') >= 1
        assert metric(page, REPLICATE_PREFILL) == 0


def test_lmcache_clear_is_an_admin_action_with_the_resets_rules(
    tmp_path: Path, engines: Proc
) -> None:
    gw = gateway(tmp_path, engines, mapped=1)  # engine 1 is no instance of the controller
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0)
    prompt = text("clear me", 40)
    engine0 = engines.ready["engines"][0]["url"]
    httpx.post(
        engine0 + "/v1/completions",
        json={"model": "sim-model", "prompt": prompt, "max_tokens": 1},
        timeout=10,
    ).raise_for_status()
    tokens = list(prompt.encode())
    before = controller_post(engines, "/lookup", {"tokens": tokens}).json()["layout_info"]
    assert before == {"lmcache-instance-0": [CPU, len(tokens)]}
    path = "/admin/workers/%s/reset_prefix_cache?tier=lmcache"
    assert httpx.post(gw.url + path % 0).status_code == 401  # no admin token
    with admin(gw) as a:
        assert a.post(path % 7).status_code == 404
        bad = a.post("/admin/workers/0/reset_prefix_cache?tier=disk")
        assert bad.status_code == 400 and "tier" in bad.json()["error"]["message"]
        unmapped = a.post(path % 1)
        assert unmapped.status_code == 409
        assert "lmcache.instances" in unmapped.json()["error"]["message"]
        # the index holds the prompt on engine 0's GPU and, from LMCache's events, on its CPU
        wait_for(lambda: held(gw, prompt).get((0, "cpu"), 0) > 0, what="the CPU tier indexed")
        before_clear = held(gw, prompt)
        ok = a.post(path % 0)
        assert ok.status_code == 200, ok.text
        # LMCache reports no removal: the index forgets the cleared tier itself
        assert ok.json()["index_medium"] == "CPU"
        assert ok.json()["index_blocks_dropped"] >= before_clear[(0, "cpu")]
        after_clear = held(gw, prompt)
        assert (0, "cpu") not in after_clear, after_clear
        assert after_clear[(0, "gpu")] == before_clear[(0, "gpu")]
        # every chunk of the tier, not only this prompt's (the gateway's start-up probes)
        assert ok.json()["tokens"] >= len(tokens) and ok.json()["location"] == CPU
        assert ok.json()["event_id"].startswith("Clear")
        assert a.post(path % 0).json()["tokens"] == 0  # nothing left
        other = a.post(path % 0 + "&location=LocalDiskBackend")
        assert other.status_code == 200 and other.json()["tokens"] == 0  # no such tier
        assert other.json()["index_medium"] is None  # a tier no event reports
    after = controller_post(engines, "/lookup", {"tokens": tokens}).json()["layout_info"]
    assert after == {}
    # the engine's GPU cache is another tier: untouched by LMCache's /clear
    assert served_by(client, prompt)[1] >= 39 * BLOCK


def test_lmcache_clear_without_a_controller_answering_is_a_502(
    tmp_path: Path, engines: Proc
) -> None:
    gw = gateway(tmp_path, engines, controller=f"http://127.0.0.1:{free_port()}")
    with admin(gw) as a:
        r = a.post("/admin/workers/0/reset_prefix_cache?tier=lmcache")
    assert r.status_code == 502
    assert "did not answer /clear" in r.json()["error"]["message"]


def test_the_controllers_errors_are_lmcaches(engines: Proc) -> None:
    """Shapes and errors of LMCache 0.5.6's controller API, as the simulator serves them."""
    tokens = list(text("errors", 20).encode())
    httpx.post(
        engines.ready["engines"][0]["url"] + "/v1/completions",
        json={"model": "sim-model", "prompt": text("errors", 20), "max_tokens": 1},
        timeout=10,
    ).raise_for_status()
    zero, one = "lmcache-instance-0", "lmcache-instance-1"

    def move(src: str, dst: str, dst_loc: str = CPU, **kw: Any) -> httpx.Response:
        body = {"old_position": [src, CPU], "new_position": [dst, dst_loc], "tokens": tokens}
        return controller_post(engines, "/move", {**body, **kw})

    unknown = move("nope", one)
    assert unknown.status_code == 500
    assert unknown.json() == {
        "detail": "The number of tokens moved should be the same across all workers."
    }
    for r in (move(zero, zero), move(zero, one, "LocalDiskBackend")):
        assert (r.status_code, r.json()) == (500, {"detail": "Operation 'move' is not supported."})
    nothing = move(one, zero, should_copy=True)  # engine 1 holds none of it
    assert nothing.status_code == 200 and nothing.json()["num_tokens"] == 0
    assert nothing.json()["event_id"].startswith("Move")
    missing = controller_post(engines, "/move", {"old_position": [zero, CPU]})
    assert missing.status_code == 422
    assert missing.json()["detail"][0]["loc"] == ["body", "new_position"]
    finish = controller_post(engines, "/check_finish", {"event_id": nothing.json()["event_id"]})
    assert (finish.status_code, finish.json()) == (500, {"detail": ""})
    health = controller_post(engines, "/health", {"instance_id": zero})
    assert health.status_code == 200 and health.json()["error_codes"] == {"0": 0}
    clear = controller_post(engines, "/clear", {"instance_id": "nope", "location": CPU})
    assert clear.json() == {
        "detail": "The number of tokens cleared should be the same across all workers."
    }
    # a move without copy takes the chunks away from the source
    moved = move(zero, one, should_copy=False)
    assert moved.status_code == 200 and moved.json()["num_tokens"] == len(tokens)
    layout = controller_post(engines, "/lookup", {"tokens": tokens}).json()["layout_info"]
    assert layout == {one: [CPU, len(tokens)]}
