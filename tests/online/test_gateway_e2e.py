"""End to end: engine simulators (processes) + the gateway, the official `openai` client."""

from __future__ import annotations

import json
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import openai
import pytest

from quillcache.tokenization.local import ByteTokenizer
from quillcache.up import gateway_args, launch
from tests.online.conftest import ADMIN, Stack, metric
from tests.online.helpers import free_port, http_get, http_post, wait_for


def long_prompt(tag: str, blocks: int = 12) -> str:
    """A prompt of `blocks` full 16-token blocks (one token per byte, builtin tokenizer)."""
    text = (f"[{tag}] " + "shared context about caching " * 40)[: blocks * 16]
    assert len(text.encode()) == blocks * 16
    return text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


def test_openai_client_streams_through_the_gateway(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    oa = client(gw.url)
    chunks = list(
        oa.completions.create(model="sim-model", prompt="Hello gateway", max_tokens=12, stream=True)
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert sum(1 for t in texts if t) == 12
    # the engine's answer, byte for byte, as the engine gives it directly
    direct = client(shared_stack.engines[0].url).completions.create(
        model="sim-model", prompt="Hello gateway", max_tokens=12
    )
    assert "".join(texts) == direct.choices[0].text

    chat_chunks = list(
        oa.chat.completions.create(
            model="sim-model",
            messages=[{"role": "user", "content": "hi there"}],
            max_tokens=5,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta.content for c in chat_chunks if c.choices]
    assert sum(1 for d in deltas if d) == 5
    assert chat_chunks[-1].choices[0].finish_reason == "length"
    full = oa.chat.completions.create(
        model="sim-model", messages=[{"role": "user", "content": "hi there"}], max_tokens=5
    )
    assert full.choices[0].message.content == "".join(d or "" for d in deltas)
    models = oa.models.list()
    assert [m.id for m in models.data] == ["sim-model"]


def test_the_native_relay_serves_the_hot_paths(shared_stack: Stack) -> None:
    """By default the Rust relay answers the completion endpoints (uvicorn, behind it,
    would add its `server` header) and proxies the rest to the Python app."""
    assert shared_stack.gateway is not None
    url = shared_stack.gateway.url
    resp = httpx.post(url + "/v1/completions", content=b"{", timeout=10)
    assert resp.status_code == 400 and "server" not in resp.headers
    assert "not valid JSON" in resp.json()["error"]["message"]
    assert httpx.get(url + "/health", timeout=10).headers.get("server") == "uvicorn"


def test_streaming_is_relayed_chunk_by_chunk(shared_stack: Stack) -> None:
    """Chunks arrive spread over time (not buffered into one write at the end)."""
    import time

    gw = shared_stack.gateway
    assert gw is not None
    arrivals = []
    with httpx.stream(
        "POST",
        gw.url + "/v1/completions",
        json={"prompt": "spread " + uuid.uuid4().hex, "max_tokens": 40, "stream": True},
        timeout=20,
    ) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.perf_counter())
    assert len(arrivals) == 41  # 40 tokens + the finish chunk
    # 40 tokens at 5 ms each: the first and the last chunk are >= 100 ms apart
    assert arrivals[-1] - arrivals[0] > 0.1


def test_shared_prefixes_go_to_the_worker_that_holds_them(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    admin = shared_stack.admin()
    for i in range(4):
        prefix = long_prompt(f"doc-{i}-{uuid.uuid4().hex[:6]}")
        first = http_post(gw.url + "/v1/completions", json={"prompt": prefix, "max_tokens": 2})
        assert first.status_code == 200
        holder = first.headers["x-quillcache-worker"]
        keys_blocks = len(ByteTokenizer().encode(prefix)) // 16
        wait_for(
            lambda p=prefix, h=holder, n=keys_blocks: any(
                str(m["worker"]) == h and m["blocks"] == n
                for m in admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
            ),
            what="the index to learn the prefix from the engine's events",
        )
        follow = http_post(
            gw.url + "/v1/completions",
            json={"prompt": prefix + " and a follow-up question", "max_tokens": 2},
        )
        assert follow.headers["x-quillcache-worker"] == holder
        cached = follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == keys_blocks * 16  # the engine confirms the hit
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_kv_blocks_stored_total") > 0
    assert metric(text, "quillcache_worker_parity_ok") == 2


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"max_tokens": 3}', 400),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400),
        # beyond the kernels' int64 (2**63): was a 500 (OverflowError)
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 9223372036854775808}', 400),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"max_completion_tokens": 99999999999999999999999}',
            400,
        ),
        ("/v1/completions", b'{"prompt": "x", "stream": "yes"}', 400),
        ("/v1/chat/completions", b'{"messages": []}', 400),
        ("/v1/chat/completions", b'{"messages": ["hi"]}', 400),
        ("/v1/chat/completions", b"\xff\xfe", 400),
        ("/v1/nothing", b"{}", 404),
        ("/v1/completions", b'{"prompt": "' + b"x" * 70_000 + b'"}', 413),
    ],
)
def test_malformed_requests_get_a_4xx_json_error(
    shared_stack: Stack, path: str, body: bytes, status: int
) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    resp = http_post(gw.url + path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    error = resp.json()["error"]
    assert error["message"] and error["code"] == status


def test_a_batch_of_prompts_is_refused_whoever_tokenizes(shared_stack: Stack) -> None:
    """Each prompt of a batch may belong on another engine: one prompt per request, said
    the same way with a local tokenizer as with the engine's (which answered its own
    error before)."""
    gw = shared_stack.gateway
    assert gw is not None
    resp = http_post(gw.url + "/v1/completions", json={"prompt": ["a batch", "of two"]})
    assert resp.status_code == 400
    assert "send a batch's prompts as separate requests" in resp.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_upstream_errors_pass_through_unchanged(
    shared_stack: Stack, path: str, stream: bool
) -> None:
    """A request the gateway lets through but the engine refuses (longer than its
    context): the engine's status and error body reach the client byte for byte."""
    gw = shared_stack.gateway
    assert gw is not None
    body: dict[str, object] = {"max_tokens": 9000, "stream": stream}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "too long an answer"}]
    else:
        body["prompt"] = "too long an answer"
    via_gateway = http_post(gw.url + path, json=body)
    direct = http_post(shared_stack.engines[0].url + path, json=body)
    assert via_gateway.status_code == direct.status_code == 400
    assert via_gateway.content == direct.content
    assert "maximum context length" in via_gateway.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client(gw.url).completions.create(
            model="sim-model", prompt="too long an answer", max_tokens=9000
        )


def test_metrics_cover_what_the_issue_lists(shared_stack: Stack) -> None:
    """Requests, route decisions by router and reason, predicted vs actual hits, events
    applied, gaps, replays, stale sources, index size, per-worker load, latency
    histograms: every family is on /metrics (after some traffic)."""
    gw = shared_stack.gateway
    assert gw is not None
    ok = http_post(gw.url + "/v1/completions", json={"prompt": long_prompt("m"), "max_tokens": 1})
    assert ok.status_code == 200
    text = http_get(gw.url + "/metrics").text
    for family in [
        'quillcache_requests_total{endpoint="/v1/completions",status="200"}',
        "quillcache_route_decisions_total{reason=",
        "quillcache_predicted_hit_tokens_total ",
        "quillcache_actual_hit_tokens_total ",
        "quillcache_kv_event_batches_applied_total ",
        "quillcache_kv_event_gaps_total ",
        "quillcache_kv_event_replays_total ",
        "quillcache_kv_event_tail_checks_total ",
        "quillcache_kv_stale_sources ",
        "quillcache_index_blocks ",
        'quillcache_worker_in_flight{worker="1"}',
        'quillcache_worker_engine_running{worker="0"}',
        'quillcache_worker_kv_usage{worker="1"}',
        "quillcache_request_seconds_bucket{",
        "quillcache_time_to_first_byte_seconds_bucket{",
        "quillcache_route_seconds_bucket{",
    ]:
        assert family in text, family
    assert metric(text, "quillcache_kv_event_batches_applied_total") > 0
    assert metric(text, "quillcache_index_blocks") > 0


def test_admin_needs_the_token(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    assert http_get(gw.url + "/admin/workers").status_code == 401
    bad = http_get(gw.url + "/admin/workers", headers={"authorization": "Bearer wrong"})
    assert bad.status_code == 401 and "admin token" in bad.json()["error"]["message"]
    workers = shared_stack.admin().get("/admin/workers").json()["workers"]
    assert [w["healthy"] for w in workers] == [True, True]


def test_http_ingest_json_and_msgpack(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    admin = shared_stack.admin()
    prompt = long_prompt("ingested-" + uuid.uuid4().hex[:8], blocks=3)
    tokens = ByteTokenizer().encode(prompt)
    stored = {
        "type": "BlockStored",
        "block_hashes": [11, 12, 13],
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    resp = admin.post("/ingest/kv_events", json={"worker": 1, "batches": [[1.0, [stored], 0]]})
    assert resp.status_code == 202, resp.text

    def cpu_match() -> bool:
        matches = admin.post("/admin/lookup", json={"prompt": prompt}).json()["matches"]
        return any(m["worker"] == 1 and m["medium"] == "CPU" and m["blocks"] == 3 for m in matches)

    wait_for(cpu_match, what="the HTTP-ingested blocks")
    removed = msgpack.packb(
        [2.0, [{"type": "BlockRemoved", "block_hashes": [11, 12, 13], "medium": "CPU"}], 0]
    )
    resp = admin.post(
        "/ingest/kv_events?worker=1",
        content=removed,
        headers={"content-type": "application/msgpack"},
    )
    assert resp.status_code == 202
    wait_for(lambda: not cpu_match(), what="the removal")
    # malformed events: 400 with the decoder's message, nothing applied
    bad = admin.post(
        "/ingest/kv_events?worker=1",
        content=b"\x93\xcb\x00",
        headers={"content-type": "application/msgpack"},
    )
    assert bad.status_code == 400 and "not a valid KV event batch" in bad.json()["error"]["message"]
    bad_json = admin.post("/ingest/kv_events", json={"worker": 1, "batches": [["nonsense"]]})
    assert bad_json.status_code == 400
    unknown = admin.post("/ingest/kv_events", json={"worker": 99, "batches": []})
    assert unknown.status_code == 404


def test_dropped_events_are_replayed(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    admin = shared_stack.admin()
    before = metric(http_get(gw.url + "/metrics").text, "quillcache_kv_event_replays_total")
    # each engine loses its next 3 batches on the PUB socket (still in its replay buffer)
    for e in shared_stack.engines:
        assert http_post(e.url + "/debug/drop_events", json={"count": 3}).status_code == 200
    prompts = [long_prompt(f"gap-{i}-{uuid.uuid4().hex[:6]}", blocks=4) for i in range(10)]
    for p in prompts:
        assert http_post(gw.url + "/v1/completions", json={"prompt": p, "max_tokens": 1}).is_success

    def all_known() -> bool:
        return all(
            any(
                m["blocks"] == 4
                for m in admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
            )
            for p in prompts
        )

    wait_for(all_known, what="every prompt's blocks, dropped batches included")
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_kv_event_gaps_total") >= 1
    assert metric(text, "quillcache_kv_event_replays_total") > before
    assert metric(text, "quillcache_kv_stale_sources") == 0


def test_a_request_whose_events_are_all_dropped_is_recovered_when_quiet(stack: Stack) -> None:
    """Every batch of a request is lost and the engine then goes quiet: no later seq
    reveals the gap; the gateway's quiet-tail check replays it."""
    engine = stack.engine()
    gw = stack.start_gateway({"event_quiet_tail_s": 0.5})
    admin = stack.admin()
    text = http_get(gw.url + "/metrics").text
    gaps = metric(text, "quillcache_kv_event_gaps_total")
    found = metric(text, "quillcache_kv_event_tail_replayed_batches_total")
    assert http_post(engine.url + "/debug/drop_events", json={"count": 1000}).status_code == 200
    prompt = long_prompt("quiet-" + uuid.uuid4().hex[:6], blocks=4)
    answer = http_post(gw.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert answer.is_success

    def known() -> bool:
        matches = admin.post("/admin/lookup", json={"prompt": prompt}).json()["matches"]
        return any(m["blocks"] == 4 for m in matches)

    wait_for(known, what="the blocks of the request whose events were all dropped")
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_kv_event_gaps_total") == gaps
    assert metric(text, "quillcache_kv_event_tail_replayed_batches_total") > found
    assert metric(text, "quillcache_kv_event_tail_checks_total") >= 1


def test_actual_hits_are_counted_from_streamed_usage(shared_stack: Stack) -> None:
    gw = shared_stack.gateway
    assert gw is not None
    text = long_prompt("usage-" + uuid.uuid4().hex[:6], blocks=5)
    body = {
        "prompt": text,
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert http_post(gw.url + "/v1/completions", json=body).status_code == 200
    before = metric(http_get(gw.url + "/metrics").text, "quillcache_actual_hit_tokens_total")
    again = http_post(gw.url + "/v1/completions", json=body)
    usage = [
        json.loads(line[6:])
        for line in again.text.splitlines()
        if line.startswith("data: {") and '"usage"' in line
    ][-1]["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached == 4 * 16  # 5 full blocks, the last one recomputed
    after = metric(http_get(gw.url + "/metrics").text, "quillcache_actual_hit_tokens_total")
    assert after - before == cached


def test_data_parallel_engine_ranks_are_subscribed_and_targeted(stack: Stack) -> None:
    engine = stack.engine(extra=["--data-parallel-size", "2"])
    sources = http_get(engine.url + "/kv_event_sources").json()["sources"]
    assert [s["dp_rank"] for s in sources] == [0, 1]
    assert sources[0]["endpoint"] != sources[1]["endpoint"]
    gw = stack.start_gateway({"router": "quillcache"})
    admin = stack.admin()
    prompts = [long_prompt(f"dp-{i}-{uuid.uuid4().hex[:6]}", blocks=6) for i in range(6)]

    def send(p: str) -> bool:
        body = {"prompt": p, "max_tokens": 64}
        return http_post(gw.url + "/v1/completions", json=body).is_success

    # At once: each rank is a routing row with its own load, so the gateway spreads
    # them over both ranks and names the rank in `X-data-parallel-rank`.
    with ThreadPoolExecutor(len(prompts)) as pool:
        assert all(pool.map(send, prompts))

    def ranks_of(p: str) -> set[int]:
        matches = admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
        return {m["dp_rank"] for m in matches if m["blocks"] == 6}

    wait_for(lambda: all(len(ranks_of(p)) == 1 for p in prompts), what="per-rank residency")
    assert set().union(*(ranks_of(p) for p in prompts)) == {0, 1}
    # follow-ups go to the rank holding their prefix: every one is a hit
    for p in prompts:
        r = http_post(gw.url + "/v1/completions", json={"prompt": p + " more", "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 6 * 16
    text = http_get(engine.url + "/metrics").text
    assert 'vllm:num_requests_running{engine="1"' in text


def _free_port_pair() -> int:
    """A port p with p + 1 free as well (rank r listens on the base port + r)."""
    for _ in range(50):
        base = free_port()
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", base))
                b.bind(("127.0.0.1", base + 1))
            except OSError:
                continue
            return base
    raise AssertionError("no two consecutive free ports")


def test_configured_endpoints_the_gateway_binds_and_all_blocks_cleared(stack: Stack) -> None:
    """Endpoints from the config instead of discovery, vLLM's loopback rule (the engine's
    PUB connects, the gateway binds), two DP ranks on base port + rank, replay on the
    replay base port + rank; then an AllBlocksCleared (/reset_prefix_cache) empties
    what the index holds for the engine."""
    pub, replay = _free_port_pair(), _free_port_pair()
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",  # no `*`: the engine connects
        "replay_endpoint": f"tcp://*:{replay}",
    }
    engine = stack.engine(extra=["--data-parallel-size", "2", "--kv-events-config", json.dumps(kv)])
    worker = {
        "url": engine.url,
        "kv_endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "kv_bind": True,
        "dp_ranks": 2,
    }
    config = stack.workdir / "configured.json"
    config.write_text(
        json.dumps({"admin_token": ADMIN, "tokenizer": "builtin", "workers": [worker]})
    )
    gw = launch(
        "gateway-configured", gateway_args([], extra=["--config", str(config)]), stack.workdir
    )
    stack.procs.append(gw)
    stack.gateway = gw
    admin = stack.admin()
    (described,) = admin.get("/admin/workers").json()["workers"]
    assert [(s["endpoint"], s["bind"]) for s in described["kv_sources"]] == [
        (f"tcp://127.0.0.1:{pub}", True),
        (f"tcp://127.0.0.1:{pub + 1}", True),
    ]
    prompts = [long_prompt(f"cfg-{i}-{uuid.uuid4().hex[:6]}", blocks=4) for i in range(6)]
    for i, p in enumerate(prompts):  # one per rank, alternately
        r = http_post(
            engine.url + "/v1/completions",
            json={"prompt": p, "max_tokens": 1},
            headers={"x-data-parallel-rank": str(i % 2)},
        )
        assert r.status_code == 200

    def ranks_of(p: str) -> set[int]:
        matches = admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
        return {m["dp_rank"] for m in matches if m["blocks"] == 4}

    wait_for(
        lambda: [ranks_of(p) for p in prompts] == [{i % 2} for i in range(6)],
        what="both ranks' events through the sockets the gateway bound",
    )
    # like vLLM, the engine refuses a reset while a request runs: the gateway's parity
    # probe may still be running on a loaded host
    wait_for(
        lambda: http_post(engine.url + "/reset_prefix_cache").status_code == 200,
        what="the engine idle to reset its prefix cache",
    )
    wait_for(
        lambda: all(not ranks_of(p) for p in prompts), what="AllBlocksCleared to empty the index"
    )
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_kv_stale_sources") == 0


def test_lora_requests_have_their_own_namespace(stack: Stack) -> None:
    stack.engine(extra=["--lora-modules", "sql-lora"])
    gw = stack.start_gateway()
    admin = stack.admin()
    models = {m["id"]: m["parent"] for m in http_get(gw.url + "/v1/models").json()["data"]}
    assert models == {"sim-model": None, "sql-lora": "sim-model"}
    text = long_prompt("lora-" + uuid.uuid4().hex[:6], blocks=4)
    r = http_post(
        gw.url + "/v1/completions", json={"model": "sql-lora", "prompt": text, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text

    def blocks(model: str) -> int:
        body = {"model": model, "prompt": text}
        matches = admin.post("/admin/lookup", json=body).json()["matches"]
        return max((m["blocks"] for m in matches), default=0)

    wait_for(lambda: blocks("sql-lora") == 4, what="the adapter's blocks")
    assert blocks("sim-model") == 0  # the base model never matches the adapter's KV


@pytest.mark.parametrize(
    "router", ["round-robin", "quillcache", "tests.online.custom_router:HighestWorker"]
)
def test_requests_go_only_to_engines_serving_their_model(stack: Stack, router: str) -> None:
    """Two engines serving different models (one with a LoRA adapter): each request goes
    to an engine that lists its model, whatever the router (HighestWorker would always
    pick worker 1); an unknown model is OpenAI's 404 `model_not_found`; when the only
    engine of a model is down, 503, never the other model's engine; /ready answers 503
    once no engine is routable, while /health (liveness) stays 200."""
    a = stack.engine(model="model-a", extra=["--lora-modules", "lora-a"])
    b = stack.engine(model="model-b")
    gw = stack.start_gateway({"router": router, "health_interval_s": 0.2})
    oai = client(gw.url)
    served = {"model-a": "0", "lora-a": "0", "model-b": "1"}
    listed = {m.id: m.parent for m in oai.models.list().data}  # the union of the engines'
    assert listed == {"model-a": None, "lora-a": "model-a", "model-b": None}
    for i in range(4):
        for model, worker in served.items():
            prompt = long_prompt(f"{model}-{i}-{uuid.uuid4().hex[:6]}", blocks=2)
            raw = oai.completions.with_raw_response.create(model=model, prompt=prompt, max_tokens=1)
            assert raw.headers["x-quillcache-worker"] == worker, (model, router)
            assert raw.parse().model == model
    with oai.completions.with_streaming_response.create(
        model="model-b", prompt="streamed", max_tokens=2, stream=True
    ) as streamed:
        assert streamed.headers["x-quillcache-worker"] == "1"
        assert any(line.startswith("data: [DONE]") for line in streamed.iter_lines())
    with pytest.raises(openai.NotFoundError) as missing:
        oai.completions.create(model="model-c", prompt="x", max_tokens=1)
    assert missing.value.code == "model_not_found"
    body = missing.value.body
    assert isinstance(body, dict) and body["param"] == "model" and "model-c" in body["message"]
    chat = http_post(
        gw.url + "/v1/chat/completions",
        json={"model": "model-c", "messages": [{"role": "user", "content": "x"}]},
    )
    assert chat.status_code == 404 and chat.json()["error"]["code"] == "model_not_found"
    # model-b's only engine goes unhealthy: its requests get 503, not model-a's engine
    assert http_post(b.url + "/debug/health", json={"healthy": False}).status_code == 200
    admin = stack.admin()
    wait_for(
        lambda: not admin.get("/admin/workers").json()["workers"][1]["healthy"],
        what="worker 1 marked down",
    )
    down = http_post(gw.url + "/v1/completions", json={"model": "model-b", "prompt": "x"})
    assert down.status_code == 503 and down.json()["error"]["message"]
    ok = http_post(gw.url + "/v1/completions", json={"model": "model-a", "prompt": "x"})
    assert ok.status_code == 200 and ok.headers["x-quillcache-worker"] == "0"
    readiness = http_get(gw.url + "/ready")
    assert readiness.status_code == 200 and readiness.json()["routable_workers"] == [0]
    assert http_post(a.url + "/debug/health", json={"healthy": False}).status_code == 200
    wait_for(lambda: http_get(gw.url + "/ready").status_code == 503, what="no routable worker")
    assert http_get(gw.url + "/health").status_code == 200  # liveness: the process serves


def test_a_user_router_class_from_the_config(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway({"router": "tests.online.custom_router:HighestWorker"})
    workers = {
        http_post(gw.url + "/v1/completions", json={"prompt": f"u{i}", "max_tokens": 1}).headers[
            "x-quillcache-worker"
        ]
        for i in range(4)
    }
    assert workers == {"1"}
    text = http_get(gw.url + "/metrics").text
    assert (
        'quillcache_route_decisions_total{reason="highest",router="HighestWorker",worker="1"}'
        in text
    )


@pytest.mark.parametrize("relay", ["native", "python"])
def test_a_router_that_raises_gets_a_json_500_not_a_hang(stack: Stack, relay: str) -> None:
    stack.engine()
    gw = stack.start_gateway({"router": "tests.online.custom_router:Broken", "relay": relay})
    for _ in range(2):
        resp = httpx.post(
            gw.url + "/v1/completions", json={"prompt": "p", "max_tokens": 1}, timeout=10
        )
        assert resp.status_code == 500
        assert resp.json()["error"]["type"] == "InternalServerError"
    assert http_get(gw.url + "/health").status_code == 200


def test_speculative_residency_steers_a_twin_request_before_any_event(stack: Stack) -> None:
    """Two requests with one long prefix, the second sent while the first is still in
    prefill (no BlockStored yet): the pending prefix sends it to the same worker."""
    import threading

    stack.engine()
    stack.engine()
    gw = stack.start_gateway({"router": "quillcache"})
    text = (f"[twin-{uuid.uuid4().hex[:6]}] " + "a long document " * 400)[:2880]
    results: dict[str, str] = {}

    def send(name: str) -> None:
        r = http_post(gw.url + "/v1/completions", json={"prompt": text, "max_tokens": 1})
        results[name] = r.headers["x-quillcache-worker"]

    first = threading.Thread(target=send, args=("first",))
    first.start()
    time.sleep(0.05)  # routed, prefill (~300 ms at the default time scale) not done
    send("second")
    first.join(timeout=30)
    assert results["first"] == results["second"]


def test_an_engine_whose_event_sources_fail_at_first_is_subscribed_all_the_same(
    stack: Stack,
) -> None:
    """A 503 from /kv_event_sources at start-up is retried: read as "no event source",
    the engine would be routed without its KV events for good."""
    engine = stack.engine()
    failing = {"path": "/kv_event_sources", "times": 2, "status": 503}
    assert http_post(engine.url + "/debug/fail", json=failing).status_code == 200
    stack.start_gateway({})
    (described,) = stack.admin().get("/admin/workers").json()["workers"]
    assert len(described["kv_sources"]) == 1
    prompt = {"prompt": long_prompt("subscribed", blocks=4), "max_tokens": 1}
    assert http_post(stack.gateway.url + "/v1/completions", json=prompt).status_code == 200
    wait_for(
        lambda: stack.admin().get("/admin/index").json()["blocks"] > 0,
        what="the engine's events in the index",
    )


def test_a_data_parallel_engines_own_load_is_read_per_rank(stack: Stack) -> None:
    """Clients that bypass the gateway keep rank 0 busy: the engine's per-rank gauges
    (vLLM's `engine` label) raise rank 0's load in the plane, not half of it on each
    rank, so the gateway's requests go to rank 1."""
    engine = stack.engine(extra=["--data-parallel-size", "2"])
    gw = stack.start_gateway({"router": "least-loaded"})
    admin = stack.admin()

    def bypass(i: int) -> int:
        body = {"prompt": f"bypass {i}", "max_tokens": 1000}  # seconds of decode
        headers = {"x-data-parallel-rank": "0"}
        return http_post(engine.url + "/v1/completions", json=body, headers=headers).status_code

    def seen_on_rank_0() -> float:
        (w,) = admin.get("/admin/workers").json()["workers"]
        rank = w["load"]["ranks"].get("0", {})
        return float(rank.get("running", 0) + rank.get("waiting", 0))

    with ThreadPoolExecutor(3) as pool:
        busy = [pool.submit(bypass, i) for i in range(3)]
        wait_for(lambda: seen_on_rank_0() >= 3, what="the scrape of rank 0's own requests")
        before = _finished_by_rank(http_get(engine.url + "/metrics").text)
        for i in range(4):
            body = {"prompt": f"through the gateway {i}", "max_tokens": 1}
            assert http_post(gw.url + "/v1/completions", json=body).status_code == 200
        after = _finished_by_rank(http_get(engine.url + "/metrics").text)
        assert {r: after[r] - before[r] for r in after} == {"0": 0, "1": 4}
        assert [f.result() for f in busy] == [200] * 3


def _finished_by_rank(text: str) -> dict[str, float]:
    """vLLM's requests finished by length per `engine` (dp rank) label, ranks 0 and 1."""
    done = {"0": 0.0, "1": 0.0}
    for line in text.splitlines():
        if line.startswith("vllm:request_success_total{") and 'reason="length"' in line:
            for rank in done:
                if f'engine="{rank}"' in line:
                    done[rank] += float(line.rsplit(" ", 1)[1])
    return done
