"""Cold start from a peer's snapshot (issue 16 §2): real gateway processes, engine
simulators whose replay buffer is too short to rebuild their residency, a peer that has
caught up; the joiner takes the peer's index image and is ready with it. Bad snapshots
(damaged, truncated, another format, another secret, too slow, no peer) are refused and
the joiner starts cold, as it would without one."""

from __future__ import annotations

import http.server
import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import xxhash

from quillcache.gateway.peer_snapshot import DIGEST_BYTES
from quillcache.up import Proc, launch
from tests.online.conftest import ADMIN, Stack, metric
from tests.online.helpers import free_port, http_get, wait_for
from tests.state.server import RedisServer

BUFFER_STEPS = 4  # the engines' replay buffer: far shorter than their history


def engine_args(
    buffer_steps: int = BUFFER_STEPS, port: int = 0, kv_ports: tuple[int, int] | None = None
) -> list[str]:
    # fixed ports: `*` as host, so that the engine binds (vLLM's rule), as it does for `:*`
    pub, replay = (
        (f"tcp://*:{kv_ports[0]}", f"tcp://*:{kv_ports[1]}")
        if kv_ports
        else ("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
    )
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub,
        "replay_endpoint": replay,
        "buffer_steps": buffer_steps,
    }
    return [
        "engine-sim",
        "--port",
        str(port),
        "--model",
        "sim-model",
        "--time-scale",
        "0",
        "--kv-events-config",
        json.dumps(kv),
    ]


def start_engine(stack: Stack) -> Proc:
    proc = launch(f"engine{len(stack.engines)}", engine_args(), stack.workdir)
    stack.procs.append(proc)
    stack.engines.append(proc)
    return proc


def prompt(tag: str, blocks: int = 6) -> str:
    text = (f"[{tag}] " + "cold start context of the fleet " * 40)[: blocks * 16]
    assert len(text.encode()) == blocks * 16
    return text


def admin(proc: Proc) -> httpx.Client:
    return httpx.Client(
        base_url=proc.url, timeout=10.0, headers={"authorization": f"Bearer {ADMIN}"}
    )


def holders(proc: Proc, text: str) -> dict[int, int]:
    """worker id -> blocks of `text` the replica's index says it holds."""
    with admin(proc) as a:
        r = a.post("/admin/lookup", json={"model": "sim-model", "prompt": text})
    assert r.status_code == 200, r.text
    return {m["worker"]: m["blocks"] for m in r.json()["matches"]}


def history(stack: Stack, tag: str) -> None:
    """Many batches on every engine, straight to the engines (as clients of another
    gateway would): far more than their replay buffers hold."""
    for engine in stack.engines:
        for i in range(4 * BUFFER_STEPS):
            r = httpx.post(
                engine.url + "/v1/completions",
                json={"model": "sim-model", "prompt": prompt(f"{tag}{i}", 2), "max_tokens": 2},
                timeout=30.0,
            )
            assert r.status_code == 200, r.text


def complete(proc: Proc, text: str) -> str:
    r = httpx.post(
        proc.url + "/v1/completions",
        json={"model": "sim-model", "prompt": text, "max_tokens": 2},
        timeout=30.0,
    )
    assert r.status_code == 200, r.text
    return r.headers["x-quillcache-worker"]


class ColdFleet:
    """Two engines with short replay buffers and a peer replica that has seen a history
    far longer than those buffers: its early prefix is in no engine's buffer any more."""

    def __init__(self, tmp: Path) -> None:
        self.stack = Stack(tmp)
        start_engine(self.stack)
        start_engine(self.stack)
        self.peer = self.stack.start_gateway({"router": "quillcache"})
        self.early = prompt("early")
        complete(self.peer, self.early)
        wait_for(lambda: holders(self.peer, self.early), what="the peer indexing the prefix")
        history(self.stack, "later")
        self.holder = max(holders(self.peer, self.early).items(), key=lambda kv: kv[1])[0]
        wait_for(lambda: self.peer_caught_up(), what="the peer applying the history")

    def peer_caught_up(self) -> bool:
        with admin(self.peer) as a:
            sources = a.get("/admin/index").json()["event_sources"]
        return all(s["caught_up"] and s["last_seq"] >= BUFFER_STEPS for s in sources)

    def joiner(self, **config: object) -> Proc:
        return self.stack.start_gateway({"router": "quillcache", **config})

    def close(self) -> None:
        self.stack.kill_all()


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ColdFleet]:
    fleet = ColdFleet(tmp_path_factory.mktemp("cold"))
    try:
        yield fleet
    finally:
        fleet.close()


def scrape(proc: Proc) -> str:
    return http_get(proc.url + "/metrics").text


def test_without_a_snapshot_the_replay_does_not_reach_back(cold: ColdFleet) -> None:
    """The control: a replica starting cold is ready but its index misses the early
    prefix (the engines' buffers no longer hold it), so the next test proves the
    snapshot, not the replay, brought it."""
    plain = cold.joiner()
    try:
        assert http_get(plain.url + "/ready").status_code == 200
        assert holders(plain, cold.early) == {}
        assert 'quillcache_bootstrap_info{outcome="none",peer="",source="none"} 1.0' in scrape(
            plain
        )
    finally:
        plain.kill()


def test_joiner_loads_the_peer_snapshot_and_routes_to_the_holder_when_ready(
    cold: ColdFleet,
) -> None:
    joiner = cold.joiner(bootstrap_from=[cold.peer.url])
    try:
        # the port opens once start-up, the bootstrap included, is done
        ready = http_get(joiner.url + "/ready")
        assert ready.status_code == 200, ready.text
        boot = ready.json()["bootstrap"]
        assert boot["outcome"] == "loaded" and boot["source"] == "url", boot
        assert boot["sources_kept"] == 2 and boot["sources_dropped"] == 0, boot
        assert boot["blocks_loaded"] > 0
        assert holders(joiner, cold.early) == holders(cold.peer, cold.early)
        assert complete(joiner, cold.early) == str(cold.holder)
        text = scrape(joiner)
        assert metric(text, "quillcache_bootstrap_blocks_loaded") == boot["blocks_loaded"]
        assert metric(text, "quillcache_bootstrap_snapshots_total") == 1
        assert 'quillcache_bootstrap_sources{state="kept"} 2.0' in text
        assert metric(scrape(cold.peer), "quillcache_peer_snapshots_served_total") >= 1
        # events after the snapshot still reach the joiner: a new prefix through the peer
        fresh = prompt("after-join")
        complete(cold.peer, fresh)
        wait_for(lambda: holders(joiner, fresh), what="the joiner applying new events")
    finally:
        joiner.kill()


def test_a_snapshot_needs_the_admin_token(cold: ColdFleet) -> None:
    r = httpx.get(cold.peer.url + "/admin/snapshot", timeout=10.0)
    assert r.status_code == 401, r.text
    r = httpx.get(
        cold.peer.url + "/admin/snapshot",
        headers={"authorization": "Bearer wrong"},
        timeout=10.0,
    )
    assert r.status_code == 401, r.text


def _peer_bytes(cold: ColdFleet) -> bytes:
    with admin(cold.peer) as a:
        r = a.get("/admin/snapshot")
    assert r.status_code == 200, r.text
    return r.content


class BadPeer:
    """A real HTTP server on 127.0.0.1 that answers /admin/snapshot with given bytes (a
    damaged copy of a real snapshot), optionally cut short or trickled."""

    def __init__(self, body: bytes, *, declared: int | None = None, trickle_s: float = 0.0):
        self.body = body
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-type", "application/octet-stream")
                self.send_header("content-length", str(declared or len(outer.body)))
                self.end_headers()
                if trickle_s:  # in 64 pieces, each after trickle_s
                    piece = max(1, len(outer.body) // 64)
                    for i in range(0, len(outer.body), piece):
                        self.wfile.write(outer.body[i : i + piece])
                        self.wfile.flush()
                        time.sleep(trickle_s)
                else:
                    self.wfile.write(outer.body)
                self.close_connection = True

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _redigest(data: bytes) -> bytes:
    body = data[:-DIGEST_BYTES]
    return body + xxhash.xxh3_128_digest(body)


def _corrupt(data: bytes) -> bytes:
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :]


def _wrong_version(data: bytes) -> bytes:
    return _redigest(data[:8] + struct.pack(">I", 99) + data[12:])


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("corrupt", "corrupt"),
        ("truncated", "truncated"),
        ("version", "version"),
        ("slow", "slow"),
        ("peer_down", "peer"),
        ("secret", "secret"),
        ("too_large", "too_large"),
    ],
)
def test_a_bad_snapshot_is_refused_and_the_joiner_starts_cold(
    cold: ColdFleet, case: str, reason: str, tmp_path: Path
) -> None:
    good = _peer_bytes(cold)
    bad: BadPeer | None = None
    config: dict[str, object] = {}
    if case == "corrupt":
        bad = BadPeer(_corrupt(good))
    elif case == "truncated":
        bad = BadPeer(good[: len(good) // 2], declared=len(good))
    elif case == "version":
        bad = BadPeer(_wrong_version(good))
    elif case == "slow":
        bad = BadPeer(good, trickle_s=0.1)  # 6.4 s in all
        config["bootstrap_timeout_s"] = 1.0
    elif case == "too_large":
        config["bootstrap_max_bytes"] = 1024
    elif case == "secret":
        config["secret_file"] = str(tmp_path / f"other-secret-{uuid.uuid4().hex}.json")
    if case == "peer_down":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens there
    else:
        url = bad.url if bad is not None else cold.peer.url
    try:
        joiner = cold.joiner(bootstrap_from=[url], **config)
        try:
            ready = http_get(joiner.url + "/ready")
            assert ready.status_code == 200, ready.text
            boot = ready.json()["bootstrap"]
            assert boot["outcome"] == "refused", boot
            assert [r["reason"] for r in boot["refusals"]] == [reason], boot
            assert boot["blocks_loaded"] == 0
            text = scrape(joiner)
            line = (
                f'quillcache_bootstrap_snapshots_total{{outcome="refused",reason="{reason}"}} 1.0'
            )
            assert line in text
            assert holders(joiner, cold.early) == {}  # cold, not a partial image
            log = joiner.log_path.read_text()
            assert f"refused ({reason})" in log, log[-2000:]
        finally:
            joiner.kill()
    finally:
        if bad is not None:
            bad.close()


def test_sources_whose_buffer_moved_on_since_the_snapshot_are_dropped(cold: ColdFleet) -> None:
    """A snapshot taken earlier (real bytes of the peer, served as they were) whose seqs
    the engines' buffers no longer hold: every source is dropped and started cold, the
    early prefix is not taken on trust."""
    old = BadPeer(_peer_bytes(cold))
    try:
        history(cold.stack, "moved-on")  # past every engine's 4-batch buffer
        joiner = cold.joiner(bootstrap_from=[old.url])
        try:
            boot = http_get(joiner.url + "/ready").json()["bootstrap"]
            assert boot["outcome"] == "loaded", boot
            assert boot["sources_kept"] == 0 and boot["sources_dropped"] == 2, boot
            assert all("no longer reaches back" in d["why"] for d in boot["dropped"]), boot
            assert holders(joiner, cold.early) == {}
            assert 'quillcache_bootstrap_sources{state="dropped"} 2.0' in scrape(joiner)
        finally:
            joiner.kill()
    finally:
        old.close()


def test_a_source_whose_engine_restarted_since_the_snapshot_is_dropped(tmp_path: Path) -> None:
    """Engine 0 restarts (same ports, seqs from 0 again, other bytes) after the snapshot
    was taken: its source is dropped, engine 1's is kept with what it holds."""
    stack = Stack(tmp_path)
    ports = [free_port() for _ in range(3)]
    try:

        def engine0() -> Proc:
            args = engine_args(buffer_steps=64, port=ports[0], kv_ports=(ports[1], ports[2]))
            return launch(f"engine0-{uuid.uuid4().hex[:4]}", args, stack.workdir)

        first = engine0()
        stack.procs.append(first)
        stack.engines.append(first)
        start_engine(stack)  # engine 1
        peer = stack.start_gateway({"router": "quillcache"})
        texts = {i: prompt(f"restart-{i}") for i in range(2)}
        for i, engine in enumerate(stack.engines):
            r = httpx.post(
                engine.url + "/v1/completions",
                json={"model": "sim-model", "prompt": texts[i], "max_tokens": 2},
                timeout=30.0,
            )
            assert r.status_code == 200
        for i in range(2):

            def indexed(i: int = i) -> bool:
                return holders(peer, texts[i]) == {i: 6}

            wait_for(indexed, what=f"engine {i} indexed")
        snapshot = BadPeer(_snapshot_of(peer))
        first.kill()
        second = engine0()  # a new life on the same ports
        stack.procs.append(second)
        stack.engines[0] = second
        for i in range(6):  # more batches than the first life had: seqs overlap
            r = httpx.post(
                second.url + "/v1/completions",
                json={"model": "sim-model", "prompt": prompt(f"new-life{i}", 2), "max_tokens": 2},
                timeout=30.0,
            )
            assert r.status_code == 200
        try:
            joiner = stack.start_gateway({"router": "quillcache", "bootstrap_from": [snapshot.url]})
            boot = http_get(joiner.url + "/ready").json()["bootstrap"]
            assert boot["sources_kept"] == 1 and boot["sources_dropped"] == 1, boot
            [dropped] = boot["dropped"]
            assert dropped["worker"] == 0 and "restarted" in dropped["why"], boot
            assert holders(joiner, texts[1]) == {1: 6}
            assert holders(joiner, texts[0]) == {}  # the old life's blocks are not taken
        finally:
            snapshot.close()
    finally:
        stack.kill_all()


def _snapshot_of(proc: Proc) -> bytes:
    with admin(proc) as a:
        r = a.get("/admin/snapshot")
    assert r.status_code == 200, r.text
    return r.content


def test_a_joiner_finds_a_ready_peer_through_redis(tmp_path: Path) -> None:
    """With `state: redis`, a ready replica advertises its URL under the fleet's prefix;
    a joiner with no bootstrap_from takes the snapshot from it. A killed peer's lease
    lapses and a later joiner starts cold instead of failing."""
    redis = RedisServer("redis-server", tmp_path).start()
    stack = Stack(tmp_path)
    try:
        start_engine(stack)
        start_engine(stack)
        shared = {
            "state": redis.url,
            "state_prefix": f"t{uuid.uuid4().hex[:8]}",
            "state_lease_ttl_s": 1.0,
            "state_budget_s": 0.25,
            "host": "127.0.0.1",
            "router": "quillcache",
        }
        peer = stack.start_gateway(shared)
        early = prompt("redis-early")
        complete(peer, early)
        wait_for(lambda: holders(peer, early), what="the peer indexing the prefix")
        history(stack, "redis-later")
        time.sleep(1.0)  # the peer has advertised itself (every lease TTL / 3)
        joiner = stack.start_gateway(shared)
        boot = http_get(joiner.url + "/ready").json()["bootstrap"]
        assert boot["outcome"] == "loaded" and boot["source"] == "redis", boot
        assert boot["peer"] == peer.url
        assert holders(joiner, early) == holders(peer, early)
        # both replicas die; their leases lapse; the next joiner finds no peer
        peer.kill()
        joiner.kill()
        time.sleep(1.5)
        late = stack.start_gateway(shared)
        boot = http_get(late.url + "/ready").json()["bootstrap"]
        assert boot["outcome"] == "none" and boot["source"] == "none", boot
        assert holders(late, early) == {}
    finally:
        stack.kill_all()
        redis.stop()
