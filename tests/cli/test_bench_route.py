"""`quillcache bench-route`: the fleet it builds is the one it claims, its JSON is
whole, a user's router can be timed, and bad flags get a message, not a traceback."""

from __future__ import annotations

import json

from quillcache.bench.route_cli import BLOCK_SIZE, PREFIX_BLOCKS, build_fleet
from quillcache.index import create_backend
from tests.cli.test_conventions import quillcache


def test_every_request_shares_block_0_with_the_fleet_and_its_prefix_with_1_to_3() -> None:
    fleet = build_fleet(engines=12, conversations_per_engine=2, requests=40, seed=3)
    index = create_backend("native")
    try:
        for engine, payloads in fleet.stored.items():
            index.apply(engine, payloads)
        for keys, tokens, _ in fleet.requests:
            assert tokens == len(keys) * BLOCK_SIZE
            hits = index.match_columns(keys)
            assert sorted(set(hits.worker.tolist())) == list(range(12))  # block 0: everyone
            deep = {int(w) for w, b in zip(hits.worker, hits.blocks, strict=True) if b > 1}
            assert 1 <= len(deep) <= 3
            assert max(hits.blocks.tolist()) == PREFIX_BLOCKS  # the conversation, not more
    finally:
        index.close()


def test_json_names_each_router_and_fleet_size_and_times_a_users_router() -> None:
    spec = "tests.online.custom_router:HighestWorker"
    proc = quillcache(
        "bench-route", "--engines", "4,16", "--requests", "40", "--routers",
        f"least-loaded,{spec}", "--json", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)["results"]  # nothing but the JSON on stdout
    assert [(r["router"], r["engines"]) for r in results] == [
        ("least-loaded", 4), (spec, 4), ("least-loaded", 16), (spec, 16),
    ]  # fmt: skip
    for r in results:
        assert 0 < r["decide_p50_us"] <= r["decide_p99_us"]
    assert "routing decision cost" in proc.stderr  # the table went to stderr


def test_bad_flags_are_named() -> None:
    for args, words in (
        (["--engines", "4,x"], "--engines wants comma-separated integers"),
        (["--engines", "0"], "at least one fleet size >= 1"),
        (["--routers", "round-robin,nope"], "unknown routers nope"),
        (["--routers", "no.such:Router"], "cannot import"),
        (["--requests", "0"], "--requests must be >= 1"),
        (["--index", "nope", "--engines", "2"], "nope"),
    ):
        proc = quillcache("bench-route", *args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert words in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)


def test_sessions_time_the_session_path() -> None:
    """`--sessions`: requests carry their conversation as a session id, and the
    session-aware routers decide on it (homes found, sessions continued)."""
    proc = quillcache(
        "bench-route", "--engines", "8", "--requests", "60", "--routers",
        "quillcache,session-affinity", "--sessions", "--json", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    payload = json.loads(proc.stdout)
    assert payload["args"]["sessions"] is True
    assert [r["router"] for r in payload["results"]] == ["quillcache", "session-affinity"]
    assert "sessions" in proc.stderr  # the table says what it timed
