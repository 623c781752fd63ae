"""Failures end to end: engines killed (SIGKILL) mid-stream or before a connect, engine
restarts (seq back to 0), client disconnects, API keys and bad configuration."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from quillcache.errors import ConfigError
from quillcache.gateway.config import load_config
from quillcache.gateway.h1 import HALF_CLOSE_GRACE_S
from quillcache.up import launch
from tests.online.conftest import Stack, metric
from tests.online.helpers import free_port, http_get, http_post, wait_for

pytestmark = pytest.mark.slow  # real processes, SIGKILLs and restarts: ~1 min in all


def prompt(tag: str) -> str:
    return (f"[{tag}] " + "a long shared document " * 20)[:160]


def test_engine_killed_mid_stream(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    gw = stack.start_gateway(
        {"router": "round-robin", "health_interval_s": 0.2, "tokenizer": "engine"}
    )
    admin = stack.admin()
    oa = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=20)
    raw = oa.completions.with_raw_response.create(
        model="sim-model", prompt=prompt("victim"), max_tokens=400, stream=True
    )
    victim = int(raw.headers["x-quillcache-worker"])
    stream = raw.parse()
    got = 0
    with pytest.raises(openai.APIError, match="mid-stream"):
        for _chunk in stream:
            got += 1
            if got == 3:
                stack.engines[victim].kill()  # SIGKILL while it streams
    assert got >= 3
    # the dead engine gets no traffic; every new request is served by the survivor
    for i in range(6):
        r = oa.completions.with_raw_response.create(
            model="sim-model", prompt=prompt(f"after-{i}"), max_tokens=2
        )
        assert int(r.headers["x-quillcache-worker"]) == 1 - victim
        assert r.parse().choices[0].text
    workers = {w["id"]: w for w in admin.get("/admin/workers").json()["workers"]}
    assert workers[victim]["healthy"] is False and workers[1 - victim]["healthy"] is True
    # and its residency is gone from the index
    matches = admin.post("/admin/lookup", json={"prompt": prompt("victim")}).json()["matches"]
    assert all(m["worker"] != victim for m in matches)


def test_failed_connect_is_retried_on_another_worker(stack: Stack) -> None:
    stack.engine()
    stack.engine()
    # health checks far apart: only the failed connect can reveal the dead engine
    gw = stack.start_gateway({"router": "round-robin", "health_interval_s": 60})
    stack.engines[0].kill()
    for i in range(4):
        r = http_post(gw.url + "/v1/completions", json={"prompt": f"retry {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.headers["x-quillcache-worker"] == "1"
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_upstream_retries_total") == 1  # then it is known down
    assert metric(text, "quillcache_worker_healthy") == 1


def test_a_failed_connect_is_retried_on_another_engine_serving_the_model(stack: Stack) -> None:
    """Engines 0 and 2 serve model-b, engine 1 model-a; engine 0 dies unnoticed: the
    request that meets it is retried on engine 2, never on the other model's engine."""
    stack.engine(model="model-b")
    stack.engine(model="model-a")
    stack.engine(model="model-b")
    gw = stack.start_gateway({"router": "round-robin", "health_interval_s": 60})
    stack.engines[0].kill()
    for i in range(4):
        body = {"model": "model-b", "prompt": f"retry {i}", "max_tokens": 1}
        r = http_post(gw.url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-quillcache-worker"] == "2"
    assert metric(http_get(gw.url + "/metrics").text, "quillcache_upstream_retries_total") == 1


def test_unreachable_tokenize_engine_is_marked_down_and_another_asked(stack: Stack) -> None:
    """With the engines' own /tokenize, a dead engine the health check has not seen yet
    must not turn requests into 400s: found by real vLLM killed between two checks."""
    stack.engine()
    stack.engine()
    gw = stack.start_gateway({"tokenizer": "engine", "health_interval_s": 60})
    stack.engines[0].kill()  # worker 0 is the first routable one: it is asked to tokenize
    for i in range(3):
        r = http_post(gw.url + "/v1/completions", json={"prompt": f"tok {i}", "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.headers["x-quillcache-worker"] == "1"
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_upstream_retries_total") == 1  # then it is known down
    assert metric(text, "quillcache_worker_healthy") == 1
    stack.engines[1].kill()  # no engine left to tokenize with: 503, never a 400 or 500
    r = http_post(gw.url + "/v1/completions", json={"prompt": "tok", "max_tokens": 1})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"]


def test_parity_probe_events_lost_without_a_later_batch_are_replayed(stack: Stack) -> None:
    """The probe's batches never reach the gateway and nothing follows them to reveal the
    gap (seen with real vLLM: published before its connecting PUB had the subscription):
    the check fetches them from the replay socket instead of reporting a mismatch."""
    engine = stack.engine()
    assert http_post(engine.url + "/debug/drop_events", json={"count": 20}).status_code == 200
    stack.start_gateway({"tokenizer": "engine"})
    with stack.admin() as admin:
        wait_for(
            lambda: admin.get("/admin/workers").json()["workers"][0]["parity"] != "unchecked",
            timeout=20,
            what="the parity check",
        )
        worker = admin.get("/admin/workers").json()["workers"][0]
    assert worker["parity"] == "ok"


def test_engine_restart_resets_its_sequence_and_cache(stack: Stack) -> None:
    http_port, kv_port, replay_port = free_port(), free_port(), free_port()
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # no `*`: the engine connects and the gateway binds, as vLLM on a loopback address
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    args = ["engine-sim", "--port", str(http_port), "--kv-events-config", json.dumps(kv)]
    engine = launch("restartable", args, stack.workdir)
    stack.procs.append(engine)
    stack.engines.append(engine)
    gw = stack.start_gateway({"health_interval_s": 0.2})
    admin = stack.admin()
    old = [prompt(f"before-{i}-{uuid.uuid4().hex[:6]}") for i in range(8)]
    for p in old:
        assert http_post(gw.url + "/v1/completions", json={"prompt": p, "max_tokens": 1}).is_success

    def holds(p: str) -> bool:
        matches = admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
        return any(m["worker"] == 0 and m["blocks"] == 10 for m in matches)

    wait_for(lambda: all(holds(p) for p in old), what="residency before the restart")
    engine.kill()
    wait_for(
        lambda: not admin.get("/admin/workers").json()["workers"][0]["healthy"],
        what="the gateway to see the engine die",
    )
    engine = launch("restartable2", args, stack.workdir)  # same ports, seq from 0 again
    stack.procs.append(engine)
    wait_for(
        lambda: admin.get("/admin/workers").json()["workers"][0]["healthy"],
        what="the engine back",
    )
    new = prompt("after-" + uuid.uuid4().hex[:6])
    for _ in range(3):  # a few batches, fewer than before: seq goes backwards
        assert http_post(
            gw.url + "/v1/completions", json={"prompt": new, "max_tokens": 1}
        ).is_success
        time.sleep(0.2)
    wait_for(lambda: holds(new), what="residency learned from the new engine")
    assert not any(holds(p) for p in old)  # the old cache did not survive the restart
    text = http_get(gw.url + "/metrics").text
    assert metric(text, "quillcache_kv_engine_restarts_total") >= 1


def test_client_disconnect_cancels_the_upstream_request(stack: Stack) -> None:
    engine = stack.engine()
    gw = stack.start_gateway({"api_keys": ["k1"], "tokenizer": "engine"})  # engine /tokenize
    body = {"prompt": "a long answer please", "max_tokens": 2000, "stream": True}
    denied = http_post(gw.url + "/v1/completions", json=body)
    assert denied.status_code == 401 and denied.json()["error"]["type"] == "AuthenticationError"
    headers = {"authorization": "Bearer k1"}
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        running = metric(http_get(engine.url + "/metrics").text, "vllm:num_requests_running")
        assert running == 1
    # the client is gone: the engine stops generating long before its 10 s answer ends
    wait_for(
        lambda: metric(http_get(engine.url + "/metrics").text, "vllm:num_requests_running") == 0,
        timeout=3,
        what="the engine to abort the request",
    )
    assert aborted(engine.url) == 1
    # and the gateway counts it in flight no more, also after scraping the engine's load
    # (a scrape that saw the request still running used to latch it there for good)
    time.sleep(1.5)  # > scrape_interval_s
    in_flight = metric(http_get(gw.url + "/metrics").text, "quillcache_worker_in_flight")
    assert in_flight == 0


def aborted(engine_url: str) -> float:
    """vLLM's count of requests finished by an abort (the client went away)."""
    text = http_get(engine_url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def test_client_disconnect_cancels_a_non_streamed_request(stack: Stack) -> None:
    """A non-streamed request: the client hangs up while the engine is generating; the
    gateway closes its upstream connection and the engine aborts the request."""
    engine = stack.engine()
    gw = stack.start_gateway()
    body = json.dumps({"prompt": "a long answer please", "max_tokens": 2000}).encode()
    host, port = gw.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        running = lambda: metric(  # noqa: E731
            http_get(engine.url + "/metrics").text, "vllm:num_requests_running"
        )
        wait_for(lambda: running() == 1, what="the engine to run the request")
        assert aborted(engine.url) == 0
        # an end of input right behind the request is a half-close (the client still
        # reads its answer); later, the client has left
        time.sleep(HALF_CLOSE_GRACE_S + 0.5)
    finally:
        sock.close()  # the client leaves ~10 s before the answer would be complete
    wait_for(lambda: aborted(engine.url) == 1, timeout=5, what="the engine to abort it")
    # (waited for, not asserted: the gateway's startup parity probes may still be running)
    wait_for(lambda: running() == 0, timeout=5, what="the engine to run nothing")
    wait_for(
        lambda: metric(http_get(gw.url + "/metrics").text, "quillcache_worker_in_flight") == 0,
        what="the gateway to forget the request",
    )
    assert metric(http_get(gw.url + "/metrics").text, "quillcache_client_disconnects_total") == 1
    # the engine still serves, and a completed request is no abort
    ok = http_post(gw.url + "/v1/completions", json={"prompt": "short", "max_tokens": 2})
    assert ok.status_code == 200 and aborted(engine.url) == 1


def test_bad_config_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "gw.yaml"
    bad.write_text("workers:\n  - url: localhost:8000\nrouter: 3\nbogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(bad)
    message = str(info.value)
    assert "workers.0.url" in message and "bogus" in message
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    broken = tmp_path / "gw.toml"
    broken.write_text("port = [")
    with pytest.raises(ConfigError, match="not valid"):
        load_config(broken)
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "gateway", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "invalid gateway config" in proc.stderr and "Traceback" not in proc.stderr


def test_a_port_in_use_is_a_clear_error(stack: Stack) -> None:
    engine = stack.engine()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        args = ["--port", str(port), "--worker", engine.url, "--tokenizer", "builtin"]
        proc = subprocess.run(
            [sys.executable, "-m", "quillcache", "gateway", *args, "--no-parity-check"],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        taken.close()
    assert proc.returncode == 2, proc.stderr
    assert "Address already in use" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_router_fails_startup_clearly(stack: Stack) -> None:
    stack.engine()
    path = stack.workdir / "gw.json"
    path.write_text(json.dumps({"router": "no-such-router", "tokenizer": "builtin"}))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "quillcache",
            "gateway",
            "--port",
            "0",
            "--config",
            str(path),
            "--worker",
            stack.engines[0].url,
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 2
    assert "unknown router 'no-such-router'" in proc.stderr


def test_gateway_restart_with_a_persistent_index_resumes_by_replay(stack: Stack) -> None:
    engine = stack.engine()
    index_dir = stack.workdir / "index"
    cfg = {"index": "native-wal", "index_options": {"path": str(index_dir)}}
    gw = stack.start_gateway(cfg)
    admin = stack.admin()

    def held(url: str, p: str) -> int:
        with httpx.Client(base_url=url, headers=admin.headers, timeout=10) as c:
            matches = c.post("/admin/lookup", json={"prompt": p}).json()["matches"]
        return max((m["blocks"] for m in matches), default=0)

    before = [prompt(f"kept-{i}-{uuid.uuid4().hex[:6]}") for i in range(12)]
    for p in before:
        resp = http_post(gw.url + "/v1/completions", json={"prompt": p, "max_tokens": 1})
        assert resp.is_success
    wait_for(lambda: all(held(gw.url, p) == 10 for p in before), what="residency")
    time.sleep(0.1)  # the WAL's interval fsync (10 ms)
    with httpx.Client(base_url=gw.url, headers=admin.headers) as c:
        last_before = c.get("/admin/index").json()["event_sources"][0]["last_seq"]
    assert last_before >= len(before)
    gw.kill()  # SIGKILL: no snapshot, no goodbye
    # while the gateway is down the engine keeps caching (and publishing to nobody)
    during = [prompt(f"missed-{i}-{uuid.uuid4().hex[:6]}") for i in range(3)]
    for p in during:
        resp = http_post(engine.url + "/v1/completions", json={"prompt": p, "max_tokens": 1})
        assert resp.is_success
    gw2 = stack.start_gateway(cfg)
    # from the log: everything before; from the engine's replay socket: everything missed
    wait_for(lambda: all(held(gw2.url, p) == 10 for p in before + during), what="recovery")
    with httpx.Client(base_url=gw2.url, headers=admin.headers) as c:
        source = c.get("/admin/index").json()["event_sources"][0]
    # the replay started after the persisted seq, not at 0
    assert len(during) <= source["replayed_batches"] < last_before
    assert source["stale_marks"] == 0 and source["restarts"] == 0


def test_admin_adds_drains_and_removes_workers(stack: Stack) -> None:
    first = stack.engine()
    gw = stack.start_gateway({"router": "round-robin"})
    second = stack.engine()  # started after the gateway: added through the admin API
    admin = stack.admin()
    # its KV endpoint to bind is held by another socket: a 409 that adds nothing (no
    # worker without events, no id used up), and the same engine is added afterwards
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        refused = admin.post(
            "/admin/workers",
            json={"url": second.url, "kv_endpoint": f"tcp://127.0.0.1:{taken}", "kv_bind": True},
        )
    assert refused.status_code == 409, refused.text
    error = refused.json()["error"]
    assert error["type"] == "ConflictError" and "nothing was added" in error["message"]
    assert [w["id"] for w in admin.get("/admin/workers").json()["workers"]] == [0]
    added = admin.post("/admin/workers", json={"url": second.url})
    assert added.status_code == 201 and added.json()["id"] == 1
    bad = admin.post("/admin/workers", json={"url": "not-a-url"})
    assert bad.status_code == 400 and "url" in bad.json()["error"]["message"]
    # the gateway itself is no engine: its requests would come back to it, round and round
    itself = admin.post("/admin/workers", json={"url": gw.url})
    assert itself.status_code == 400, itself.text
    assert "is a QuillCache gateway, not an engine" in itself.json()["error"]["message"]
    wait_for(
        lambda: admin.get("/admin/workers/1").json()["parity"] == "ok", what="parity of worker 1"
    )

    def served(n: int = 4) -> set[str]:
        return {
            http_post(
                gw.url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 1}
            ).headers["x-quillcache-worker"]
            for i in range(n)
        }

    assert served() == {"0", "1"}
    assert admin.post("/admin/workers/0/drain", json={"draining": True}).status_code == 200
    assert served() == {"1"}
    assert admin.post("/admin/workers/0/drain", json={"draining": False}).status_code == 200
    assert admin.delete("/admin/workers/1").json() == {"removed": 1}
    assert served() == {"0"}
    assert admin.delete("/admin/workers/1").status_code == 404
    not_an_id = admin.delete("/admin/workers/abc")
    assert not_an_id.status_code == 404
    assert "worker ids are whole numbers" in not_an_id.json()["error"]["message"]
    models = http_get(gw.url + "/v1/models").json()["data"]
    assert [m["id"] for m in models] == ["sim-model"]
    pinned = admin.post("/admin/pins", json={"prompt": "x" * 64})
    assert pinned.json()["pinned"] == 4
    assert admin.request("DELETE", "/admin/pins", json={"prompt": "x" * 64}).json() == {
        "unpinned": 4
    }
    assert first.alive()


def test_load_scraped_from_engines_steers_least_loaded_routing(stack: Stack) -> None:
    import threading

    busy = stack.engine()
    stack.engine()
    gw = stack.start_gateway({"router": "least-loaded", "scrape_interval_s": 0.2})
    stop = threading.Event()

    def hog() -> None:  # a client that bypasses the gateway and keeps engine 0 busy
        body = {"prompt": "hog", "max_tokens": 4000, "stream": True}
        with httpx.stream("POST", busy.url + "/v1/completions", json=body, timeout=60) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    hogs = [threading.Thread(target=hog, daemon=True) for _ in range(3)]
    for t in hogs:
        t.start()
    try:
        wait_for(
            lambda: (
                'quillcache_worker_engine_running{worker="0"} 3.0'
                in http_get(gw.url + "/metrics").text
            ),
            what="the gateway to scrape engine 0's load",
        )
        workers = {
            http_post(
                gw.url + "/v1/completions", json={"prompt": f"q{i}", "max_tokens": 1}
            ).headers["x-quillcache-worker"]
            for i in range(4)
        }
        assert workers == {"1"}
    finally:
        stop.set()
        for t in hogs:
            t.join(timeout=10)


def test_a_python_index_backend_behind_the_gateway(stack: Stack) -> None:
    """The pure-Python `memory` index is not thread-safe: ingest and routing share a lock."""
    stack.engine()
    stack.engine()
    gw = stack.start_gateway({"index": "memory", "router": "quillcache"})
    admin = stack.admin()
    prompts = [prompt(f"mem-{i}-{uuid.uuid4().hex[:6]}") for i in range(20)]
    for p in prompts:
        assert http_post(gw.url + "/v1/completions", json={"prompt": p, "max_tokens": 1}).is_success

    def known(p: str) -> bool:
        matches = admin.post("/admin/lookup", json={"prompt": p}).json()["matches"]
        return any(m["blocks"] == 10 for m in matches)

    wait_for(lambda: all(known(p) for p in prompts), what="residency in the memory index")
    assert admin.get("/admin/index").json()["index"] == "memory"


def test_a_request_no_engine_can_tokenize_says_why(stack: Stack) -> None:
    """The engines tokenize and the only one is draining: a 503 that says so (was: "no
    healthy engine", about an engine that is healthy)."""
    stack.engine()
    gw = stack.start_gateway({"tokenizer": "engine"})
    admin = stack.admin()
    assert admin.post("/admin/workers/0/drain", json={"draining": True}).status_code == 200
    r = http_post(gw.url + "/v1/completions", json={"prompt": "a text prompt", "max_tokens": 1})
    assert r.status_code == 503, r.text
    assert "of 1 serving the model, 1 draining and 0 down" in r.json()["error"]["message"]
