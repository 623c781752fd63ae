"""Several gateway replicas sharing their state through a real `redis-server` (issue 16
§1/§2): engine simulators and gateways as processes, the official `openai` client."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis as redis_client

from quillcache.up import LaunchError, Proc, launch
from tests.online.conftest import metric
from tests.online.fleet import LEASE_TTL_S, Fleet, client, prompt
from tests.online.helpers import http_get, wait_for


def scrape(proc: Proc, name: str) -> float:
    return metric(http_get(proc.url + "/metrics").text, name)


@pytest.mark.parametrize("relay", ["native", "python"])
def test_replicas_route_a_workload_end_to_end(tmp_path: Path, relay: str) -> None:
    """Both data paths book in Redis: the native relay's and the ASGI app's."""
    fleet = Fleet(tmp_path, relay)
    try:
        _route_a_workload(fleet)
    finally:
        fleet.close()


def _route_a_workload(fleet: Fleet) -> None:
    for _ in range(3):
        fleet.stack.engine()
    replicas = [fleet.replica(router="quillcache") for _ in range(3)]
    clients = [client(r.url) for r in replicas]

    def one(i: int) -> str:
        oa = clients[i % len(clients)]
        tag = f"user{i % 6}"  # six prefixes, each reused through every replica
        out = oa.completions.create(model="sim-model", prompt=prompt(tag), max_tokens=4)
        return out.choices[0].text

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(60)))
    assert all(answers)
    shared = [
        metric(
            http_get(r.url + "/metrics").text, 'quillcache_state_bookings_total{outcome="shared"}'
        )
        for r in replicas
    ]
    assert sum(shared) == 60, shared
    assert all(n > 0 for n in shared)
    assert (
        sum(scrape(r, 'quillcache_state_bookings_total{outcome="fallback"}') for r in replicas) == 0
    )
    # every booking released: nothing left in flight in Redis
    wait_for(lambda: fleet.in_flight() == 0, 5.0, "the fleet's load back to zero")


def burst(
    fleet: Fleet, gateways: list[Proc], tag: str, n: int = 64, shared: int = 8, own: int = 8
) -> list[int]:
    """`n` requests sharing a new `shared`-block prefix (each with `own` blocks of its
    own) spread over `gateways`, released together; the per-engine counts, largest
    first."""
    names = [fleet.urls_by_id(g) for g in gateways]
    clients = [client(g.url, timeout=60.0) for g in gateways]
    gate = threading.Barrier(n)
    text = prompt(tag, blocks=shared)

    def one(i: int) -> str:
        oa = clients[i % len(clients)]
        body = text + (f"<{i:04d}>" * 4 * own)[: 16 * own]
        gate.wait()
        raw = oa.completions.with_raw_response.create(model="sim-model", prompt=body, max_tokens=16)
        return names[i % len(clients)][raw.headers["x-quillcache-worker"]]

    with ThreadPoolExecutor(n) as pool:
        urls = list(pool.map(one, range(n)))
    counts = Counter(urls)
    return sorted((counts.get(e.url, 0) for e in fleet.stack.engines), reverse=True)


def test_a_burst_through_four_replicas_spreads_as_one_gateway_does(fleet: Fleet) -> None:
    """No herding: every replica's router sees the same cold engines, the booking step
    spreads the burst as one gateway seeing every booking does (within one request per
    engine). A router that spreads by load, with `state_cache_slack` 0: the ceilings then
    value a cached prefix as the router does, not at all. For cache-affinity routers the
    derived ceilings do not reproduce one gateway (docs/state.md, "How the gateway uses
    it")."""
    router = "least-loaded"
    for _ in range(4):
        fleet.stack.engine(time_scale=5.0)  # the burst's requests overlap
    replicas = [fleet.replica(router=router, state_cache_slack=0.0) for _ in range(4)]
    spread = burst(fleet, replicas, f"burst-fleet-{router}")
    wait_for(lambda: fleet.in_flight() == 0, 10.0, "the burst's bookings released")
    one = fleet.stack.start_gateway({"router": router})  # local state, on its own
    alone = burst(fleet, [one], f"burst-alone-{router}")
    assert sum(spread) == sum(alone) == 64
    assert all(abs(a - b) <= 1 for a, b in zip(spread, alone, strict=True)), (spread, alone)


def test_a_burst_sharing_a_new_prefix_lands_through_four_replicas_as_through_one(
    fleet: Fleet,
) -> None:
    """The `quillcache` router counts a prefix being computed as reusable, so one
    gateway sends a burst sharing a new 40-block prefix (one block of its own each) to
    the engine computing it. It gives the booking step its own shortlist
    (`Router.shortlist`): ceilings from its cost model and a credit for the prefix
    being computed, and the script books each request's prefill as the prompt beyond
    that prefix, so four replicas that all saw the same cold engines place the burst
    as one gateway does (each engine's count within 1, the issue's bound), instead of
    spreading it by load (docs/state.md, "Ceilings from the router"; the anchors' tails
    give the exact depth being computed, "Anchors")."""
    router = "quillcache"
    for _ in range(4):
        fleet.stack.engine(time_scale=5.0)  # the burst's requests overlap
    replicas = [fleet.replica(router=router) for _ in range(4)]
    spread = burst(fleet, replicas, f"affinity-fleet-{router}", shared=40, own=1)
    wait_for(lambda: fleet.in_flight() == 0, 10.0, "the burst's bookings released")
    one = fleet.stack.start_gateway({"router": router})  # local state, on its own
    alone = burst(fleet, [one], f"affinity-alone-{router}", shared=40, own=1)
    assert sum(spread) == sum(alone) == 64
    # when it fails, say whether a replica fell back (Redis slower than the budget)
    # or booked in Redis and still went elsewhere
    outcomes = [
        {
            o: scrape(r, f'quillcache_state_bookings_total{{outcome="{o}"}}')
            for o in ("shared", "fallback")
        }
        | {
            step: scrape(r, f'quillcache_state_booking_steps_total{{step="{step}"}}')
            for step in ("pending", "under", "over")
        }
        for r in replicas
    ]
    assert all(abs(a - b) <= 1 for a, b in zip(spread, alone, strict=True)), (
        spread,
        alone,
        outcomes,
    )


def stream_tokens(url: str, tag: str, max_tokens: int, started: threading.Event) -> int:
    """Stream one completion; the number of non-empty chunks (raises on a broken stream)."""
    oa = client(url, timeout=60.0)
    n = 0
    for chunk in oa.completions.create(
        model="sim-model", prompt=prompt(tag), max_tokens=max_tokens, stream=True
    ):
        if chunk.choices and chunk.choices[0].text:
            n += 1
            started.set()
    return n


def test_a_replica_killed_mid_stream_leaves_no_load_and_no_trace(fleet: Fleet) -> None:
    for _ in range(2):
        fleet.stack.engine()
    doomed, survivor = fleet.replica(), fleet.replica()
    n = 4
    started = [threading.Event() for _ in range(2 * n)]
    with ThreadPoolExecutor(2 * n) as pool:
        theirs = [
            pool.submit(stream_tokens, survivor.url, f"b{i}", 300, started[i]) for i in range(n)
        ]
        ours = [
            pool.submit(stream_tokens, doomed.url, f"a{i}", 300, started[n + i]) for i in range(n)
        ]
        for e in started:
            assert e.wait(20)
        assert fleet.in_flight() == 2 * n
        # the survivor's routers see the whole fleet's bookings, not only its own
        wait_for(
            lambda: scrape(survivor, "quillcache_worker_in_flight") == 2 * n,
            2.0,
            "the fleet's load in the survivor's view",
        )
        doomed.kill()  # SIGKILL: no goodbye, its lease left to lapse
        killed = time.monotonic()
        wait_for(lambda: fleet.in_flight() == n, LEASE_TTL_S + 1.5, "the dead replica's load gone")
        gone_after = time.monotonic() - killed
        wait_for(
            lambda: scrape(survivor, "quillcache_worker_in_flight") == n,
            1.0,
            "the dead replica's load out of the survivor's view",
        )
        assert not any(f.done() for f in theirs), "the survivor's streams ended too early"
        # the survivor's clients see nothing: every stream whole
        assert [f.result() for f in theirs] == [300] * n
        for f in ours:
            with pytest.raises(openai.APIError):
                f.result()
    assert gone_after <= LEASE_TTL_S + 1.5
    wait_for(lambda: fleet.in_flight() == 0, 5.0, "the survivor's bookings released")


def test_redis_stopped_and_restarted_under_load(fleet: Fleet) -> None:
    """Redis dies: the replicas route on their local view and every request is answered;
    Redis comes back empty: they reconnect and put their bookings back (resync)."""
    for _ in range(2):
        fleet.stack.engine()
    replicas = [fleet.replica(), fleet.replica()]
    started = [threading.Event() for _ in range(4)]
    stop = threading.Event()
    errors: list[BaseException] = []
    answered = Counter[str]()

    def load(r: Proc) -> None:
        oa = client(r.url)
        i = 0
        while not stop.is_set():
            try:
                oa.completions.create(model="sim-model", prompt=prompt(f"l{i % 5}"), max_tokens=2)
                answered[r.url] += 1
            except BaseException as exc:
                errors.append(exc)
            i += 1

    with ThreadPoolExecutor(8) as pool:
        streams = [
            pool.submit(stream_tokens, replicas[i % 2].url, f"s{i}", 700, started[i])
            for i in range(4)
        ]
        for e in started:
            assert e.wait(20)
        loaders = [pool.submit(load, r) for r in replicas]
        try:
            wait_for(lambda: fleet.in_flight() >= 4, 5.0, "the streams booked in Redis")
            fleet.redis.stop()
            for r in replicas:
                wait_for(
                    functools.partial(lambda r: scrape(r, "quillcache_state_up") == 0, r),
                    5.0,
                    "fail open",
                )
            before = {r.url: answered[r.url] for r in replicas}
            wait_for(
                lambda: all(answered[r.url] >= before[r.url] + 5 for r in replicas),
                10.0,
                "requests answered on the local view",
            )
            fallbacks = [
                scrape(r, 'quillcache_state_bookings_total{outcome="fallback"}') for r in replicas
            ]
            assert all(f > 0 for f in fallbacks), fallbacks
            fleet.redis.start(same_port=True)  # empty: no persistence
            for r in replicas:
                wait_for(
                    functools.partial(lambda r: scrape(r, "quillcache_state_up") == 1, r),
                    5.0,
                    "reconnected",
                )
                assert scrape(r, "quillcache_state_reconnects_total") >= 1
            shared_before = [
                scrape(r, 'quillcache_state_bookings_total{outcome="shared"}') for r in replicas
            ]
            wait_for(
                lambda: all(
                    scrape(r, 'quillcache_state_bookings_total{outcome="shared"}') > b
                    for r, b in zip(replicas, shared_before, strict=True)
                ),
                5.0,
                "bookings shared again",
            )
            stop.set()
            for f in loaders:
                f.result()
            # the streams still running are back in Redis, and nothing else
            wait_for(lambda: fleet.in_flight() == 4, 3.0, "the replicas' bookings resynced")
            assert not any(f.done() for f in streams), "streams ended before the check"
        finally:
            stop.set()
        assert [f.result() for f in streams] == [700] * 4
    assert not errors, errors[:3]
    wait_for(lambda: fleet.in_flight() == 0, 5.0, "every booking released")


def workers_of(fleet: Fleet, proc: Proc) -> dict[str, dict[str, object]]:
    with fleet.admin(proc) as a:
        return {w["url"]: w for w in a.get("/admin/workers").json()["workers"]}


def pins_of(fleet: Fleet, proc: Proc) -> int:
    """The fleet's pins this replica applied to its index."""
    with fleet.admin(proc) as a:
        return int(a.get("/admin/index").json()["shared_state"]["pins"])


def test_admin_changes_reach_every_replica(fleet: Fleet) -> None:
    e0, e1 = fleet.stack.engine(), fleet.stack.engine()
    a, b = fleet.replica(), fleet.replica()
    with fleet.admin(a) as admin:
        ids = {w["url"]: w["id"] for w in admin.get("/admin/workers").json()["workers"]}
        r = admin.post(f"/admin/workers/{ids[e1.url]}/drain", json={"draining": True})
        assert r.status_code == 200 and r.json()["shared"] is True
        pinned = {"model": "sim-model", "prompt": prompt("pinned", blocks=6)}
        r = admin.post("/admin/pins", json=pinned)
        assert r.status_code == 200
        assert (r.json()["pinned"], r.json()["shared"]) == (6, True)
        e2 = fleet.stack.engine()
        r = admin.post("/admin/workers", json={"url": e2.url})
        assert r.status_code == 201 and r.json()["shared"] is True
    wait_for(lambda: workers_of(fleet, b)[e1.url]["draining"] is True, 5.0, "drain seen by b")
    wait_for(lambda: e2.url in workers_of(fleet, b), 5.0, "the added engine seen by b")
    wait_for(lambda: pins_of(fleet, b) == 1, 5.0, "the pin seen by b")
    # and listed by b, made through a: an admin behind a load balancer sees it either way
    with fleet.admin(a) as on_a, fleet.admin(b) as on_b:
        (mine,) = on_a.get("/admin/pins").json()["pins"]
        (theirs,) = on_b.get("/admin/pins").json()["pins"]
    assert mine["blocks"] == theirs["blocks"] == 6 and mine["owner"] == theirs["owner"]
    # b keeps it warm too (it adopted the pin), with the TTL Redis has left for it
    assert "kept_warm_by" not in theirs and theirs["name"] == mine["name"]
    assert 0 < theirs["ttl_left_s"] <= mine["ttl_left_s"] + 1.0
    assert mine["ttl_left_s"] - theirs["ttl_left_s"] < 5.0
    # b routes around the engine a drained
    oa = client(b.url)
    names = fleet.urls_by_id(b)
    for i in range(6):
        raw = oa.completions.with_raw_response.create(
            model="sim-model", prompt=prompt(f"d{i}"), max_tokens=2
        )
        assert names[raw.headers["x-quillcache-worker"]] != e1.url
    # a replica started later, configured with the first engines only, finds the fleet
    # as the admin API left it
    fleet.stack.engines.remove(e2)
    c = fleet.replica()
    fleet.stack.engines.append(e2)
    seen = workers_of(fleet, c)
    assert seen[e1.url]["draining"] is True and e2.url in seen and e0.url in seen
    assert pins_of(fleet, c) == 1
    # and the undoing travels too
    with fleet.admin(b) as admin:
        ids = {w["url"]: w["id"] for w in admin.get("/admin/workers").json()["workers"]}
        admin.post(f"/admin/workers/{ids[e1.url]}/drain", json={"draining": False})
        r = admin.request("DELETE", "/admin/pins", json=pinned)
        assert r.status_code == 200 and r.json()["unpinned"] == 6
        assert admin.delete(f"/admin/workers/{ids[e2.url]}").json()["shared"] is True
    for p in (a, c):
        wait_for(
            functools.partial(lambda p: workers_of(fleet, p)[e1.url]["draining"] is False, p),
            5.0,
            "undrain",
        )
        wait_for(
            functools.partial(lambda p: e2.url not in workers_of(fleet, p), p),
            5.0,
            "engine removal",
        )
        wait_for(functools.partial(lambda p: pins_of(fleet, p) == 0, p), 5.0, "unpin")


def test_start_up_refuses_what_cannot_work_with_replicas(fleet: Fleet) -> None:
    e = fleet.stack.engine()
    fleet.replica()
    # an engine whose publisher connects to one gateway cannot serve several replicas
    bound = {"url": e.url, "kv_endpoint": "tcp://127.0.0.1:5999", "kv_bind": True}
    path = fleet.tmp / "bound.json"
    path.write_text(json.dumps({**fleet.config(), "workers": [bound], "tokenizer": "builtin"}))
    with pytest.raises(LaunchError) as refused:
        launch("bound", ["gateway", "--port", "0", "--config", str(path)], fleet.tmp)
    assert "exit 2" in str(refused.value)
    assert "kv_bind: true" in str(refused.value) and "bind their KV-event socket" in str(
        refused.value
    )
    # another fleet's secret: the replica refuses, saying what to do
    with pytest.raises(LaunchError) as refused:
        fleet.replica(secret_file=str(fleet.tmp / "another-secret.json"))
    assert "exit 2" in str(refused.value)
    text = str(refused.value)
    assert "is not the one fleet" in text and "give every replica of a fleet the same" in text


def test_up_starts_a_fleet_of_replicas_in_one_command(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "quillcache", "up", "--engines", "2", "--replicas", "3",
         "--workdir", str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    gateways: list[str] = []
    redis_url = ""
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("gateway:"):
                gateways.append(line.split()[1])
            elif line.startswith("shared state:"):
                redis_url = line.split()[2]
            elif line.startswith("Ctrl-C"):
                break
        assert len(gateways) == 3 and redis_url.startswith("redis://127.0.0.1:"), gateways
        for i, url in enumerate(gateways):
            out = client(url).completions.create(
                model="sim-model", prompt=f"hello replica {i}", max_tokens=3
            )
            assert out.choices[0].text
            page = http_get(url + "/metrics").text
            assert metric(page, "quillcache_state_up") == 1
            assert metric(page, 'quillcache_state_bookings_total{outcome="shared"}') == 1
            assert metric(page, "quillcache_kv_sources_caught_up") == 2  # every engine's
            # the first replica starts from the engines; each later one from a peer's
            # snapshot, found through Redis (bootstrap_discover)
            source = "none" if i == 0 else "redis"
            outcome = "none" if i == 0 else "loaded"
            info = [ln for ln in page.splitlines() if ln.startswith("quillcache_bootstrap_info{")]
            assert len(info) == 1 and f'source="{source}"' in info[0], info
            assert f'outcome="{outcome}"' in info[0] and info[0].endswith(" 1.0"), info
        # Redis goes: the stack stays up and the replicas serve on their own views
        port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
        with contextlib.suppress(redis_client.ConnectionError):
            redis_client.Redis(port=port).shutdown(nosave=True)
        time.sleep(1.5)
        assert proc.poll() is None, "up stopped the stack when redis exited"
        for url in gateways:
            out = client(url).completions.create(model="sim-model", prompt="no redis", max_tokens=2)
            assert out.choices[0].text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])

    def all_down() -> bool:
        for url in gateways:
            try:
                httpx.get(url + "/health", timeout=1)
                return False
            except httpx.HTTPError:
                continue
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return False
        except OSError:
            return True

    wait_for(all_down, 10.0, "the replicas and redis to stop")


def test_a_replica_added_under_load_joins_the_fleet(fleet: Fleet) -> None:
    """A replica started while the others serve: ready once it caught up with every
    engine, then booking in Redis next to them; nobody's clients see an error."""
    for _ in range(2):
        fleet.stack.engine()
    first = fleet.replica()
    stop = threading.Event()
    errors: list[BaseException] = []
    served = Counter[str]()

    def load(url: str) -> None:
        oa = client(url)
        i = 0
        while not stop.is_set():
            try:
                oa.completions.create(model="sim-model", prompt=prompt(f"j{i % 7}"), max_tokens=2)
                served[url] += 1
            except BaseException as exc:  # every failure is the test's
                errors.append(exc)
            i += 1

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(load, first.url)]
        try:
            wait_for(lambda: served[first.url] >= 10, 10.0, "load on the first replica")
            joined = fleet.replica()
            ready = http_get(joined.url + "/ready")
            assert ready.status_code == 200, ready.text  # caught up before it serves
            assert ready.json()["sources"] == {"total": 2, "caught_up": 2}
            running.append(pool.submit(load, joined.url))
            wait_for(lambda: served[joined.url] >= 10, 10.0, "load on the new replica")
            shared = 'quillcache_state_bookings_total{outcome="shared"}'
            assert scrape(joined, shared) >= 10
            assert scrape(joined, "quillcache_state_up") == 1
        finally:
            stop.set()
        for f in running:
            f.result()
    assert not errors, errors[:3]
    wait_for(lambda: fleet.in_flight() == 0, 5.0, "every booking released")


def test_redis_restarted_empty_keeps_the_engines_added_through_the_fleet(fleet: Fleet) -> None:
    """An engine added and a prefix pinned through the admin API live in Redis; Redis
    restarted without persistence has lost them. The running replicas keep serving the
    engine and the pin and put both back (neither was removed), so a replica started
    afterwards finds them too."""
    e0 = fleet.stack.engine()
    a, b = fleet.replica(), fleet.replica()
    e1 = fleet.stack.engine()
    with fleet.admin(a) as admin:
        r = admin.post("/admin/workers", json={"url": e1.url})
        assert r.status_code == 201 and r.json()["shared"] is True
        r = admin.post("/admin/pins", json={"model": "sim-model", "prompt": prompt("kept")})
        assert r.status_code == 200 and r.json()["shared"] is True
    wait_for(lambda: e1.url in workers_of(fleet, b), 5.0, "the added engine seen by b")
    wait_for(lambda: pins_of(fleet, b) == 1, 5.0, "the pin seen by b")
    fleet.redis.stop()
    fleet.redis.start(same_port=True)  # empty: no persistence
    for r in (a, b):
        wait_for(
            functools.partial(lambda r: scrape(r, "quillcache_state_up") == 1, r),
            5.0,
            "reconnected",
        )
    time.sleep(2.0)  # several polls of the configuration after the restart
    for r in (a, b):
        assert set(workers_of(fleet, r)) == {e0.url, e1.url}
    c = fleet.replica()
    wait_for(lambda: e1.url in workers_of(fleet, c), 5.0, "the engine put back in redis")
    wait_for(lambda: pins_of(fleet, c) == 1, 5.0, "the pin put back in redis")
    for r in (a, b):
        assert pins_of(fleet, r) == 1


def test_a_pin_outlives_the_replica_it_was_made_through(fleet: Fleet) -> None:
    """Every replica keeps the fleet's pins warm (their tokens are in Redis): after the
    replica a pin was made through is killed, another one places it again when its
    holder's cache is reset, and counts it against its owner's pin budget."""
    fleet.stack.engine()
    fleet.stack.engine()
    policy = {"interval_s": 0.2, "touch_min_interval_s": 0.5, "pin_budget_tokens": 200}
    a, b = fleet.replica(policy=policy), fleet.replica(policy=policy)
    pinned = {"model": "sim-model", "prompt": prompt("kept", blocks=8)}
    with fleet.admin(a) as admin:
        r = admin.post("/admin/pins", json=pinned, headers={"x-tenant-id": "acme"})
        assert r.status_code == 200, r.text
    a.popen.kill()
    a.popen.wait(10)

    def listed() -> list[dict[str, object]]:
        with fleet.admin(b) as admin:
            pins: list[dict[str, object]] = admin.get("/admin/pins").json()["pins"]
            return pins

    wait_for(lambda: len(listed()) == 1 and bool(listed()[0]["holders"]), 10.0, "placed")
    (pin,) = listed()
    assert "kept_warm_by" not in pin and pin["owner"] == "acme"
    holder = pin["holders"][0]  # type: ignore[index]
    with fleet.admin(b) as admin:
        r = admin.post(f"/admin/workers/{holder}/reset_prefix_cache")
        assert r.status_code == 200, r.text
    wait_for(lambda: bool(listed()[0]["holders"]), 10.0, "placed again by the survivor")
    # the adopted pin counts against the owner's budget on this replica (128 + 128 > 200)
    with fleet.admin(b) as admin:
        more = {"model": "sim-model", "prompt": prompt("more", blocks=8)}
        r = admin.post("/admin/pins", json=more, headers={"x-tenant-id": "acme"})
        assert r.status_code == 409 and "pin budget" in r.text, r.text


def test_removing_a_configured_engine_is_local_to_its_replica(fleet: Fleet) -> None:
    """An engine in the replicas' own configuration: removing it through one replica
    leaves the others serving it (and says `shared: false`), also after it was added
    back through the fleet and removed again."""
    e0 = fleet.stack.engine()
    a, b = fleet.replica(), fleet.replica()
    with fleet.admin(a) as admin:
        wid = {w["url"]: w["id"] for w in admin.get("/admin/workers").json()["workers"]}[e0.url]
        r = admin.delete(f"/admin/workers/{wid}")
        assert r.status_code == 200 and r.json()["shared"] is False, r.text
        time.sleep(1.0)  # ten polls of the fleet's configuration
        assert e0.url in workers_of(fleet, b)
        r = admin.post("/admin/workers", json={"url": e0.url})  # back, through the fleet
        assert r.status_code == 201 and r.json()["shared"] is True, r.text
        time.sleep(1.0)
        assert list(workers_of(fleet, b)) == [e0.url]
        r = admin.delete(f"/admin/workers/{r.json()['id']}")
        assert r.status_code == 200 and r.json()["shared"] is True, r.text
    time.sleep(1.0)
    assert e0.url in workers_of(fleet, b), "the fleet removed b's configured engine"
