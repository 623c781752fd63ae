"""The parity check's engine-hash half end to end, against the engine simulator: the
gateway reads the probe's BlockStored events back from the engine's replay socket and
reports its verdict in /admin/workers, in /metrics and in its log.

The simulator publishes opaque hashes and states `prefix_caching_hash_algo="xxh3_64_sim"`
in /metrics, so its verdict is "not predictable"; the verdicts on real vLLM's hashes are
in tests/online/test_real_vllm_hash_parity.py, each cause in test_hash_parity.py.
"""

from __future__ import annotations

from typing import Any

from tests.online.conftest import Stack
from tests.online.helpers import http_get, wait_for


def _workers(stack: Stack) -> list[dict[str, Any]]:
    with stack.admin() as admin:
        workers: list[dict[str, Any]] = admin.get("/admin/workers").json()["workers"]
    return workers


def test_simulator_hashes_are_not_predictable_and_routing_parity_is_ok(stack: Stack) -> None:
    stack.engine()
    gw = stack.start_gateway({"tokenizer": "engine"})
    wait_for(
        lambda: _workers(stack)[0]["hash_parity"] != "unchecked",
        timeout=30,
        what="the parity check",
    )
    w = _workers(stack)[0]
    assert w["parity"] == "ok"  # content keys match: routing sees the engine's cache
    assert w["hash_parity"].startswith("not predictable: ")
    assert "'xxh3_64_sim'" in w["hash_parity"]
    hashes = w["engine_hashes"]
    assert hashes["state"] == "not predictable" and hashes["algorithm"] == "xxh3_64_sim"
    # the probe's own blocks, read back from the engine's replay socket
    assert hashes["block_size"] == w["block_size"] and len(hashes["published"]) >= 1
    assert hashes["predicted"] == []  # nothing predicted for an algorithm not reproduced
    text = http_get(gw.url + "/metrics").text
    assert 'quillcache_worker_hash_parity{state="not_predictable",worker="0"} 1.0' in text
    assert 'quillcache_worker_hash_parity{state="mismatch",worker="0"} 0.0' in text
    assert 'quillcache_worker_parity_ok{worker="0"} 1.0' in text
    log = gw.log_path.read_text(errors="replace")
    assert "content keys match; engine hashes not predictable" in log


def test_a_worker_added_with_a_hash_seed_keeps_it(stack: Stack) -> None:
    """`hash_seed` (the engine's PYTHONHASHSEED) is a worker setting: the verdict names
    the seed the gateway predicted with."""
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    engine = stack.engine()
    with stack.admin() as admin:
        r = admin.post("/admin/workers", json={"url": engine.url, "hash_seed": "1234"})
        assert r.status_code in (200, 201), r.text
        bad = admin.post("/admin/workers", json={"url": engine.url, "hash_seed": 7})
        assert bad.status_code == 400, bad.text
    wait_for(
        lambda: _workers(stack)[0]["hash_parity"] != "unchecked",
        timeout=30,
        what="the parity check of the added worker",
    )
    assert _workers(stack)[0]["engine_hashes"]["seed"] == "1234"
