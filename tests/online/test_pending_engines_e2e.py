"""A gateway started before some of its engines (issue 16 §2): real gateway processes and
engine simulators on 127.0.0.1. The engines it cannot reach yet are pending under their
configured worker ids, listed with the reason, and join once they answer; the gateway
serves meanwhile with the engines it has."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from quillcache.up import LaunchError, Proc, launch
from tests.online.conftest import ADMIN, Stack, metric
from tests.online.helpers import free_port, http_get, wait_for
from tests.online.test_cold_start_e2e import engine_args, prompt

pytestmark = pytest.mark.timeout(120)


def start_gateway(stack: Stack, workers: list[dict[str, object]], **extra: object) -> Proc:
    path = stack.workdir / f"gateway{len(stack.procs)}.json"
    config = {
        "admin_token": ADMIN,
        "tokenizer": "builtin",
        "router": "quillcache",
        "secret_file": str(stack.workdir / "gateway-secret.json"),
        "workers": workers,
        **extra,
    }
    path.write_text(json.dumps(config))
    proc = launch(
        f"gateway{len(stack.procs)}",
        ["gateway", "--port", "0", "--config", str(path)],
        stack.workdir,
    )
    stack.procs.append(proc)
    return proc


def admin(proc: Proc) -> httpx.Client:
    return httpx.Client(
        base_url=proc.url, timeout=10.0, headers={"authorization": f"Bearer {ADMIN}"}
    )


def test_an_engine_down_at_start_is_pending_and_joins_under_its_id(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    late = [free_port() for _ in range(3)]  # its HTTP, KV and replay ports
    late_url = f"http://127.0.0.1:{late[0]}"
    try:
        up = stack.engine()
        # the late engine first: worker 0 joins after worker 1
        gw = start_gateway(stack, [{"url": late_url}, {"url": up.url}])
        with admin(gw) as a:
            listed = a.get("/admin/workers").json()
            assert [w["id"] for w in listed["workers"]] == [1]
            [pending] = listed["pending"]
            assert pending["id"] == 0 and pending["url"] == late_url
            assert "cannot list /v1/models" in pending["why"], pending
            # asked by its id, it is the pending engine (not an unknown worker)
            one = a.get("/admin/workers/0")
            assert one.status_code == 200 and one.json() == {**pending, "pending": True}
            assert metric(a.get("/metrics").text, "quillcache_workers_pending") == 1
            ready = http_get(gw.url + "/ready")
            assert ready.status_code == 200, ready.text  # the engine it has is enough
            assert [p["id"] for p in ready.json()["pending"]] == [0]
            # it routes meanwhile, to the engine it has
            r = httpx.post(
                gw.url + "/v1/completions",
                json={"model": "sim-model", "prompt": prompt("early"), "max_tokens": 2},
                timeout=30.0,
            )
            assert r.status_code == 200 and r.headers["x-quillcache-worker"] == "1"

            proc = launch("late", engine_args(port=late[0], kv_ports=(late[1], late[2])), tmp_path)
            stack.procs.append(proc)
            wait_for(
                lambda: [w["id"] for w in a.get("/admin/workers").json()["workers"]] == [0, 1],
                timeout=30,
                what="the late engine to join as worker 0, listed by id",
            )
            assert a.get("/admin/workers").json()["pending"] == []
            assert metric(a.get("/metrics").text, "quillcache_workers_pending") == 0
            # its events reach the index: what it computes is seen as held by worker 0
            text = prompt("late")
            r = httpx.post(
                late_url + "/v1/completions",
                json={"model": "sim-model", "prompt": text, "max_tokens": 2},
                timeout=30.0,
            )
            assert r.status_code == 200

            def held() -> dict[int, int]:
                body = {"model": "sim-model", "prompt": text}
                matches = a.post("/admin/lookup", json=body).json()["matches"]
                return {m["worker"]: m["blocks"] for m in matches}

            wait_for(lambda: held() == {0: 6}, what="the late engine's blocks in the index")
    finally:
        stack.kill_all()


def test_a_pending_engine_can_be_removed(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        up = stack.engine()
        gone = f"http://127.0.0.1:{free_port()}"
        gw = start_gateway(stack, [{"url": gone}, {"url": up.url}])
        with admin(gw) as a:
            assert [p["id"] for p in a.get("/admin/workers").json()["pending"]] == [0]
            assert [w["id"] for w in a.get("/admin/workers").json()["workers"]] == [1]
            r = a.delete("/admin/workers/0")
            assert r.status_code == 200 and r.json() == {"removed": 0, "pending": True}
            assert a.get("/admin/workers").json()["pending"] == []
            assert a.delete("/admin/workers/0").status_code == 404
            # an engine added through the API gets a new id, not a configured one
            extra = stack.engine()
            added = a.post("/admin/workers", json={"url": extra.url})
            assert added.status_code in (200, 201) and added.json()["id"] == 2, added.text
    finally:
        stack.kill_all()


def test_no_engine_and_no_block_size_is_refused_with_what_to_set(tmp_path: Path) -> None:
    stack = Stack(tmp_path)
    try:
        with pytest.raises(LaunchError, match="set block_size"):
            start_gateway(stack, [{"url": f"http://127.0.0.1:{free_port()}"}])
        # with the block size given it starts, not ready, and says why
        gw = start_gateway(stack, [{"url": f"http://127.0.0.1:{free_port()}"}], block_size=16)
        ready = http_get(gw.url + "/ready")
        assert ready.status_code == 503
        assert "pending: engine http://127.0.0.1" in ready.json()["missing"][0], ready.text
        assert http_get(gw.url + "/health").status_code == 200
    finally:
        stack.kill_all()


def test_an_engine_is_one_worker_however_it_joins(tmp_path: Path) -> None:
    """A pending engine added by hand once it is up (racing its own retry) ends as one
    worker, and adding a worker's URL again is a 409 that adds nothing."""
    stack = Stack(tmp_path)
    late = [free_port() for _ in range(3)]
    late_url = f"http://127.0.0.1:{late[0]}"
    try:
        up = stack.engine()
        gw = start_gateway(stack, [{"url": up.url}, {"url": late_url}])
        with admin(gw) as a:
            again = a.post("/admin/workers", json={"url": up.url})
            assert again.status_code == 409, again.text
            assert "already worker 0" in again.json()["error"]["message"]
            # the same engine under another spelling of its address, too
            alias = up.url.replace("127.0.0.1", "localhost")
            assert alias != up.url
            again = a.post("/admin/workers", json={"url": alias})
            assert again.status_code == 409, again.text
            assert "already worker 0" in again.json()["error"]["message"]
            # an OpenAI base URL (with /v1) where the engine's is wanted: says so
            v1 = a.post("/admin/workers", json={"url": up.url + "/v1"})
            assert v1.status_code == 400 and "without /v1" in v1.text, v1.text
            proc = launch("late", engine_args(port=late[0], kv_ports=(late[1], late[2])), tmp_path)
            stack.procs.append(proc)
            added = a.post("/admin/workers", json={"url": late_url})
            assert added.status_code in (201, 409), added.text  # 409: its retry won

            def urls() -> list[str]:
                return [w["url"] for w in a.get("/admin/workers").json()["workers"]]

            wait_for(lambda: late_url in urls(), timeout=30, what="the late engine, a worker")
            time.sleep(2.5)  # past the pending entry's next retries, had it stayed
            listed = a.get("/admin/workers").json()
            assert sorted(urls()) == sorted([up.url, late_url]), listed
            assert listed["pending"] == []
    finally:
        stack.kill_all()
