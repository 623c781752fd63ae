"""`/health` (liveness) and `/ready` (readiness) of a real gateway process in front of
engine simulators, and event publishers the test controls (`quillcache/gateway/readiness.py`).

/health answers 200 while the process serves, whatever the engines do; /ready answers
200 only with a routable engine whose event sources have all caught up, else 503 naming
what is missing, and /metrics carries the same progress."""

from __future__ import annotations

import json
import time

import httpx
import zmq

from quillcache.connectors import SourceStatus, ZmqSourceConfig
from quillcache.events.encode import AllBlocksCleared, encode_batch
from quillcache.gateway.config import WorkerConfig
from quillcache.gateway.readiness import readiness
from quillcache.gateway.workers import Worker
from quillcache.up import engine_args, gateway_args, launch
from tests.online.conftest import ADMIN, Stack, metric
from tests.online.helpers import free_port, http_get, http_post, wait_for


def ready(url: str) -> httpx.Response:
    return http_get(url + "/ready")


def gauges(url: str) -> tuple[float, float, float]:
    """(sources, caught up, ready) from the gateway's /metrics."""
    text = http_get(url + "/metrics").text
    return (
        metric(text, "quillcache_kv_sources"),
        metric(text, "quillcache_kv_sources_caught_up"),
        metric(text, "quillcache_ready"),
    )


def assert_alive(url: str) -> None:
    health = http_get(url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}


def test_ready_follows_the_engines_while_health_stays_200(stack: Stack) -> None:
    """One engine simulator: ready once its source replayed its (empty) buffer to the end
    marker; the engine down: 503 'no routable engine' while /health stays 200 (a
    liveness probe must not restart a gateway whose engines are down); back: 200."""
    engine = stack.engine()
    gw = stack.start_gateway({"parity_check": False, "health_interval_s": 0.2})
    wait_for(lambda: ready(gw.url).status_code == 200, what="/ready 200")
    body = ready(gw.url).json()
    assert body["status"] == "ready" and body["missing"] == [] and body["routable_workers"] == [0]
    assert body["sources"] == {"total": 1, "caught_up": 1}
    # caught up by the replay (no parity probe, no request: the engine published nothing)
    source = stack.admin().get("/admin/index").json()["event_sources"][0]
    assert source["caught_up"] and source["connected"] and source["replayed_to_end"]
    assert not source["wire_applied"]
    assert gauges(gw.url) == (1.0, 1.0, 1.0)
    assert_alive(gw.url)

    assert http_post(engine.url + "/debug/health", json={"healthy": False}).status_code == 200
    wait_for(lambda: ready(gw.url).status_code == 503, what="/ready 503 with the engine down")
    body = ready(gw.url).json()
    assert body["status"] == "not ready" and body["routable_workers"] == []
    assert body["missing"] == ["no routable engine: workers 0 (down)"]
    assert body["not_routable"] == [{"worker": 0, "url": engine.url, "why": "down"}]
    assert gauges(gw.url) == (1.0, 1.0, 0.0)  # its source did catch up: progress stays
    assert_alive(gw.url)

    assert http_post(engine.url + "/debug/health", json={"healthy": True}).status_code == 200
    wait_for(lambda: ready(gw.url).status_code == 200, what="/ready 200 with the engine back")
    # draining the only engine: not routable either
    admin = stack.admin()
    assert admin.post("/admin/workers/0/drain", json={"draining": True}).status_code == 200
    body = ready(gw.url).json()
    assert body["missing"] == ["no routable engine: workers 0 (draining)"]
    assert admin.post("/admin/workers/0/drain", json={"draining": False}).status_code == 200
    assert ready(gw.url).status_code == 200


def test_ready_waits_for_every_source_to_connect_and_catch_up(stack: Stack) -> None:
    """A worker whose event source is given in the config, at addresses where nothing
    publishes yet: 503 'not connected'; a publisher binds there but its replay socket
    never answers: still 503, 'replay not finished'; its first batch off the wire goes
    through the applier: 200. A second, ordinary engine is caught up all along."""
    other = stack.engine()
    engine = launch("engine-x", engine_args(), stack.workdir)  # its events are ours to fake
    stack.procs.append(engine)
    kv = f"tcp://127.0.0.1:{free_port()}"
    replay = f"tcp://127.0.0.1:{free_port()}"
    config = {
        "admin_token": ADMIN,
        "tokenizer": "builtin",
        "parity_check": False,
        "replay_timeout_s": 0.3,
        "event_quiet_tail_s": 0.3,
        "secret_file": str(stack.workdir / "secret.json"),
        "workers": [
            {"url": other.url},
            {"url": engine.url, "kv_endpoint": kv, "replay_endpoint": replay},
        ],
    }
    path = stack.workdir / "gateway.json"
    path.write_text(json.dumps(config))
    gw = launch("gateway", gateway_args([], extra=["--config", str(path)]), stack.workdir)
    stack.procs.append(gw)
    stack.gateway = gw

    def waiting() -> list[dict[str, object]]:
        answer = ready(gw.url)
        assert answer.status_code == (200 if not answer.json()["waiting_for"] else 503)
        return list(answer.json()["waiting_for"])

    # worker 0 catches up on its own; worker 1 cannot: nothing listens at its addresses
    wait_for(lambda: [w["worker"] for w in waiting()] == [1], what="only worker 1 waited for")
    time.sleep(1.0)  # its replay request timed out long ago: still not ready
    body = ready(gw.url).json()
    assert body["status"] == "not ready" and body["routable_workers"] == [0, 1]
    assert body["missing"] == [f"worker 1 ({engine.url}) rank 0: not connected to {kv}"]
    assert body["waiting_for"][0]["connected"] is False
    assert body["sources"] == {"total": 2, "caught_up": 1}
    assert gauges(gw.url) == (2.0, 1.0, 0.0)
    assert_alive(gw.url)

    # an engine's PUB bound where the gateway connects; nothing answers on `replay`
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(kv)
    try:
        wait_for(lambda: waiting()[0]["connected"], what="the gateway connected")
        admin = stack.admin()

        def tail_checked() -> bool:
            sources = admin.get("/admin/index").json()["event_sources"]
            return any(s["worker"] == 1 and s["tail_checks"] >= 1 for s in sources)

        wait_for(tail_checked, what="the replay check after the connection")
        body = ready(gw.url).json()
        assert body["missing"] == [
            f"worker 1 ({engine.url}) rank 0: replay from {replay} not finished"
        ]
        assert gauges(gw.url) == (2.0, 1.0, 0.0)

        # a first batch off the wire: a subscription takes a moment to reach the PUB,
        # so publish until one arrives (each clears worker 1's empty residency)
        deadline = time.monotonic() + 10
        seq = 0
        while ready(gw.url).status_code != 200:
            assert time.monotonic() < deadline, "no batch reached the gateway in 10 s"
            payload = encode_batch([AllBlocksCleared()], ts=time.time(), dp_rank=0)
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            time.sleep(0.1)
    finally:
        pub.close()
    body = ready(gw.url).json()
    assert body["status"] == "ready" and body["sources"] == {"total": 2, "caught_up": 2}
    assert gauges(gw.url) == (2.0, 2.0, 1.0)
    source = next(
        s for s in stack.admin().get("/admin/index").json()["event_sources"] if s["worker"] == 1
    )
    assert source["wire_applied"] and not source["replayed_to_end"]


def _worker(worker_id: int, ranks: int, *, healthy: bool = True, draining: bool = False) -> Worker:
    w = Worker(id=worker_id, config=WorkerConfig(url=f"http://engine-{worker_id}:8000"))
    w.healthy, w.draining = healthy, draining
    w.sources = [
        ZmqSourceConfig(worker_id, f"tcp://engine-{worker_id}:{5557 + r}", None, dp_rank=r)
        for r in range(ranks)
    ]
    return w


def test_readiness_waits_for_routable_engines_only() -> None:
    """A down or draining engine gets no traffic: its sources are counted in the
    progress but not waited for; a source the ingestor never heard of is waited for."""
    up, down, drained = _worker(0, 2), _worker(1, 1, healthy=False), _worker(2, 1, draining=True)
    statuses = {
        (0, 0): SourceStatus(0, 0, peer_connects=1),  # no replay socket: connected is enough
        (0, 1): SourceStatus(0, 1, peer_connects=1, replay_endpoint="tcp://engine-0:5600"),
        (1, 0): SourceStatus(1, 0),
        (2, 0): SourceStatus(2, 0),
    }
    state = readiness([up, down, drained], statuses)
    assert not state.ready and state.routable == [0]
    assert [(s["worker"], s["dp_rank"], s["connected"]) for s in state.waiting] == [(0, 1, True)]
    assert (state.sources, state.caught_up) == (4, 1)
    assert [w["why"] for w in state.not_routable] == ["down", "draining"]
    statuses[(0, 1)].replayed_to_end = True
    state = readiness([up, down, drained], statuses)
    assert state.ready and (state.sources, state.caught_up) == (4, 2)
    del statuses[(0, 0)]  # e.g. the worker's receiver not created (yet)
    state = readiness([up], statuses)
    assert not state.ready and state.waiting[0]["dp_rank"] == 0
    assert readiness([], {}).missing() == ["no routable engine: no engine configured"]
