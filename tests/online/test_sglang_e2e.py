"""End to end with engines speaking SGLang, as its releases really do: the gateway and
engine simulators in the SGLang flavour (`--sglang-version`) on 127.0.0.1, real ZMQ and
real HTTP. One release of each event shape: 0.5.19 (tagged arrays, the salt in a
metadata map, replay without the topic) and 0.5.23 (tagged maps, replay with it).

The gateway learns everything from `/server_info`: the page size (32 here, not the
default 16), the attention-DP ranks (one event socket per rank at the base port +
rank), the replay socket; routing then sends a prefix to the engine and rank holding it.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq

from quillcache.events import sglang as sgl
from tests.online.conftest import Stack, make_stack, metric
from tests.online.helpers import free_port, http_get, http_post, wait_for

PAGE = 32
RELEASES = ["legacy", "0.5.23"]  # 0.5.19, the last array release; a current map release


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


def prompt(tag: str, pages: int = 4) -> str:
    """`pages` full pages of the builtin tokenizer (one token per byte)."""
    text = (f"[{tag}] " + "a shared document about radix caches " * 20)[: pages * PAGE]
    assert len(text.encode()) == pages * PAGE
    return text


class SglangStack:
    def __init__(self, stack: Stack, release: str) -> None:
        self.stack, self.release = stack, release
        self.version = {"legacy": sgl.LAST_ARRAY_RELEASE}.get(release, release)
        self.pub, self.replay = _free_port_pair(), _free_port_pair()
        kv = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.pub}",
            "replay_endpoint": f"tcp://*:{self.replay}",
            "topic": "kv",
        }
        common = ["--flavor", "sglang", "--sglang-version", release, "--block-size", str(PAGE)]
        # engine 0: two attention-DP ranks on fixed ports; engine 1: one rank, any port
        self.dp = stack.engine(
            extra=[*common, "--data-parallel-size", "2", "--kv-events-config", json.dumps(kv)]
        )
        self.single = stack.engine(extra=common)
        self.gateway = stack.start_gateway({"router": "quillcache", "event_quiet_tail_s": 0.5})
        self.admin = stack.admin()

    def matches(self, text: str, salt: str | None = None) -> list[dict[str, int]]:
        body: dict[str, object] = {"prompt": text}
        if salt is not None:
            body["cache_salt"] = salt
        got: list[dict[str, int]] = self.admin.post("/admin/lookup", json=body).json()["matches"]
        return got


@pytest.fixture(scope="module", params=RELEASES)
def sglang(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SglangStack]:
    workdir: Path = tmp_path_factory.mktemp(f"sglang-{request.param}")
    for stack in make_stack(workdir):
        yield SglangStack(stack, request.param)


def test_page_size_and_dp_ranks_come_from_server_info(sglang: SglangStack) -> None:
    info = http_get(sglang.dp.url + "/server_info").json()
    assert (info["page_size"], info["dp_size"], info["version"]) == (PAGE, 2, sglang.version)
    workers = sglang.admin.get("/admin/workers").json()["workers"]
    by_url = {w["url"]: w for w in workers}
    dp, single = by_url[sglang.dp.url], by_url[sglang.single.url]
    assert dp["block_size"] == single["block_size"] == PAGE
    # its sequence slots: SGLang's --max-running-requests, from the same server info
    assert dp["max_num_seqs"] == single["max_num_seqs"] == info["max_running_requests"] > 0
    assert [(s["endpoint"], s["replay_endpoint"]) for s in dp["kv_sources"]] == [
        (f"tcp://127.0.0.1:{sglang.pub + r}", f"tcp://127.0.0.1:{sglang.replay + r}")
        for r in (0, 1)
    ]  # rank r at the base port + r
    assert len(single["kv_sources"]) == 1


def test_the_engines_publish_sglangs_format_and_replay_layout(sglang: SglangStack) -> None:
    """What the gateway reads is SGLang's wire, not vLLM's: a SUB of our own on rank 1
    and a replay request, checked against the release's shape."""
    wire = sgl.wire_of(sglang.version)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(f"tcp://127.0.0.1:{sglang.pub + 1}")
    text = prompt("wire-" + uuid.uuid4().hex[:8])
    ours = list(text.encode()[:PAGE])  # the first page's token ids (one per byte)
    batches: list[list[bytes]] = []

    def salted_store_seen() -> bool:
        http_post(
            sglang.dp.url + "/v1/completions",
            json={"prompt": text, "max_tokens": 1, "cache_salt": "acme"},
            headers={"x-data-parallel-rank": "1"},
        )
        while True:
            try:
                batches.append(sub.recv_multipart(zmq.NOBLOCK if batches else 0))
            except zmq.Again:
                break
        return any(ours == tokens[:PAGE] for _, tokens, _ in stores())

    def stores() -> Iterator[tuple[object, list[int], list[int]]]:
        """(event, token_ids, hashes) of every BlockStored received."""
        for _topic, _seq, payload in batches:
            for e in msgpack.unpackb(payload, raw=False)[1]:
                if wire.maps and e["type"] == "BlockStored":
                    yield e, e["token_ids"], e["block_hashes"]
                elif not wire.maps and e[0] == "BlockStored":
                    yield e, e[3], e[1]

    try:
        wait_for(salted_store_seen, what="our salted store on rank 1's socket")
    finally:
        sub.close(0)
    for topic, _seq, payload in batches:
        ts, _events, rank = msgpack.unpackb(payload, raw=False)
        assert topic == b"kv" and rank == 1 and isinstance(ts, float)
    for e, tokens, hashes in stores():
        assert all(-(2**63) <= h < 2**63 for h in hashes)  # SGLang's signed int64
        if wire.maps:
            assert isinstance(e, dict) and e["medium"] == "GPU"
            assert set(e) <= {"type", "block_hashes", "parent_block_hash", "token_ids",
                              "block_size", "lora_id", *wire.optional}  # fmt: skip
            salt = e.get("cache_salt")
        else:
            assert isinstance(e, list) and len(e) in (7, 8) and e[6] == "GPU"
            salt = e[7]["cache_salt"] if len(e) == 8 else None
        if tokens[:PAGE] == ours:
            assert salt == "acme"

    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(f"tcp://127.0.0.1:{sglang.replay + 1}")
    try:
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        replies = [dealer.recv_multipart()]
        while b"\xff" * 8 not in replies[-1]:
            replies.append(dealer.recv_multipart())
    finally:
        dealer.close(0)
    if wire.replay_topic:
        assert all(len(r) == 4 and r[1] == b"kv" for r in replies[:-1])
        assert replies[-1] == [b"", b"", b"\xff" * 8, b""]
    else:
        assert all(len(r) == 3 for r in replies[:-1])
        assert replies[-1] == [b"", b"\xff" * 8, b""]


def test_routing_follows_the_engine_and_rank_holding_the_prefix(sglang: SglangStack) -> None:
    gw = sglang.gateway.url
    for i in range(4):
        text = prompt(f"route-{i}-{uuid.uuid4().hex[:6]}")
        first = http_post(gw + "/v1/completions", json={"prompt": text, "max_tokens": 1})
        assert first.status_code == 200
        holder = first.headers["x-quillcache-worker"]
        wait_for(
            lambda t=text, h=holder: any(
                str(m["worker"]) == h and m["blocks"] == 4 for m in sglang.matches(t)
            ),
            what="the index to learn the prefix from SGLang's events",
        )
        follow = http_post(
            gw + "/v1/completions", json={"prompt": text + " and a question", "max_tokens": 1}
        )
        assert follow.headers["x-quillcache-worker"] == holder
        assert follow.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * PAGE


def test_cache_salt_namespaces_what_the_index_learns(sglang: SglangStack) -> None:
    """The salt SGLang sends with the stored blocks (a field, or 0.5.18-0.5.19's metadata
    map) puts them in the salted namespace: found with the salt, never without it."""
    text = prompt("salted-" + uuid.uuid4().hex[:8])
    body = {"prompt": text, "max_tokens": 1, "cache_salt": "tenant-s"}
    assert http_post(sglang.gateway.url + "/v1/completions", json=body).status_code == 200
    wait_for(
        lambda: max((m["blocks"] for m in sglang.matches(text, "tenant-s")), default=0) == 4,
        what="the salted blocks in the index",
    )
    assert sglang.matches(text) == []
    assert sglang.matches(text, "other") == []


def test_lost_events_come_back_through_sglangs_replay_layout(sglang: SglangStack) -> None:
    """Batches the PUB sockets never send: the gateway, seeing no events after routing
    a request, asks the engine's replay socket, which answers in the release's layout."""
    gw = sglang.gateway.url
    for engine in (sglang.dp, sglang.single):
        assert http_post(engine.url + "/debug/drop_events", json={"count": 100}).status_code == 200
    text = prompt("lost-" + uuid.uuid4().hex[:8])
    assert http_post(gw + "/v1/completions", json={"prompt": text, "max_tokens": 1}).is_success
    wait_for(
        lambda: max((m["blocks"] for m in sglang.matches(text)), default=0) == 4,
        what="blocks replayed from the replay socket",
    )
    assert metric(http_get(gw + "/metrics").text, "quillcache_kv_event_replays_total") >= 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--flavor", "sglang", "--sglang-version", "0.4.6"], "publishes no KV events"),
        (["--flavor", "sglang", "--sglang-version", "latest"], "not an SGLang release"),
        (["--sglang-version", "0.5.23"], "--sglang-version needs --flavor sglang"),
    ],
)
def test_bad_sglang_versions_get_a_clear_error(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "quillcache", "engine-sim", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_a_malformed_sglang_frame_is_counted_and_logged_per_source(stack: Stack) -> None:
    """An engine whose PUB connects (no `*`: the gateway binds, as SGLang's rule says):
    a PUB of the test's own connects there too and sends, with the engine's next seq, a
    0.5.19-shaped store whose metadata salt is not a string. The gateway counts it for
    that source, logs it, and keeps indexing the engine's real events."""
    pub = free_port()
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    common = ["--flavor", "sglang", "--sglang-version", "0.5.19", "--block-size", str(PAGE)]
    engine = stack.engine(extra=[*common, "--kv-events-config", json.dumps(kv)])
    gw = stack.start_gateway({"router": "quillcache"})
    admin = stack.admin()
    (worker,) = admin.get("/admin/workers").json()["workers"]
    assert worker["kv_sources"][0]["bind"]
    store = ["BlockStored", [-5], None, list(range(PAGE)), PAGE, None, "GPU", {"cache_salt": 7}]
    bad = msgpack.packb([1.0, [store], 0])
    inject = zmq.Context.instance().socket(zmq.PUB)
    inject.connect(f"tcp://127.0.0.1:{pub}")

    def counted() -> bool:
        # the engine's next seq (a duplicate seq would be skipped before decoding)
        seq = http_post(engine.url + "/debug/drop_events", json={"count": 0}).json()["next_seq"]
        inject.send_multipart([b"", seq.to_bytes(8, "big"), bad])
        time.sleep(0.05)
        text = http_get(gw.url + "/metrics").text
        return metric(text, "quillcache_kv_source_decode_errors_total") >= 1

    try:
        wait_for(counted, what="the malformed frame counted")
    finally:
        inject.close(0)
    wait_for(
        lambda: "events[0].metadata: expected cache_salt (a string)" in gw.log_path.read_text(),
        what="the malformed frame in the gateway's log",
    )
    # the engine's own batch at the injected seq is now a duplicate: spend it
    throwaway = {"prompt": prompt("spent-" + uuid.uuid4().hex[:8]), "max_tokens": 1}
    assert http_post(engine.url + "/v1/completions", json=throwaway).is_success
    text = prompt("after-bad-" + uuid.uuid4().hex[:8])
    assert http_post(gw.url + "/v1/completions", json={"prompt": text, "max_tokens": 1}).is_success

    def indexed() -> bool:
        matches = admin.post("/admin/lookup", json={"prompt": text}).json()["matches"]
        return any(m["blocks"] == 4 for m in matches)

    wait_for(indexed, what="the engine's real events still indexed")
    assert gw.alive() and engine.alive()
