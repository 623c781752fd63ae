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


def _checked(stack: Stack, seed: str | None) -> dict[str, Any]:
    """Add the last engine as a worker (with `hash_seed` when given) to a gateway with no
    workers, and return its row once the check has run."""
    body: dict[str, Any] = {"url": stack.engines[-1].url}
    if seed is not None:
        body["hash_seed"] = seed
    with stack.admin() as admin:
        r = admin.post("/admin/workers", json=body)
        assert r.status_code in (200, 201), r.text
    wait_for(
        lambda: _workers(stack)[0]["hash_parity"] != "unchecked",
        timeout=30,
        what="the parity check",
    )
    return _workers(stack)[0]


def test_sha256_cbor_simulator_with_the_right_seed_is_ok(stack: Stack) -> None:
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    stack.engine(extra=["--prefix-caching-hash-algo", "sha256_cbor", "--hash-seed", "42"])
    w = _checked(stack, "42")
    hashes = w["engine_hashes"]
    assert w["hash_parity"] == "ok", w["hash_parity"]
    assert hashes["algorithm"] == "sha256_cbor" and hashes["seed"] == "42"
    assert hashes["published"] and hashes["published"] == hashes["predicted"]
    assert w["parity"] == "ok"  # the index keys by content, whatever the engine's hashes
    text = http_get(stack.gateway.url + "/metrics").text  # type: ignore[union-attr]
    assert 'quillcache_worker_hash_parity{state="ok",worker="0"} 1.0' in text


def test_sha256_cbor_simulator_with_the_default_seed_is_ok_without_a_hash_seed(
    stack: Stack,
) -> None:
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    stack.engine(extra=["--prefix-caching-hash-algo", "sha256_cbor"])
    w = _checked(stack, None)
    assert w["hash_parity"] == "ok", w["hash_parity"]
    assert w["engine_hashes"]["seed"] == "vllm-none-hash"


def test_sha256_cbor_simulator_with_another_seed_is_a_seed_mismatch(stack: Stack) -> None:
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    stack.engine(extra=["--prefix-caching-hash-algo", "sha256_cbor", "--hash-seed", "42"])
    w = _checked(stack, "43")
    assert w["hash_parity"].startswith("mismatch: seed: "), w["hash_parity"]
    hashes = w["engine_hashes"]
    assert hashes["published"] and hashes["published"] != hashes["predicted"]
    assert w["parity"].startswith("mismatch: engine hashes: seed: ")  # the overall verdict
    text = http_get(stack.gateway.url + "/metrics").text  # type: ignore[union-attr]
    assert 'quillcache_worker_hash_parity{state="mismatch",worker="0"} 1.0' in text


def test_sha256_cbor_engine_on_the_default_seed_names_it_when_the_gateway_has_another(
    stack: Stack,
) -> None:
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    stack.engine(extra=["--prefix-caching-hash-algo", "sha256_cbor"])
    w = _checked(stack, "43")
    assert w["hash_parity"].startswith("mismatch: seed: "), w["hash_parity"]
    assert "'vllm-none-hash'" in w["hash_parity"] and "'43'" in w["hash_parity"]


def test_sha256_pickle_simulator_is_not_predictable(stack: Stack) -> None:
    stack.start_gateway({"tokenizer": "engine", "parity_check": True})
    stack.engine(extra=["--prefix-caching-hash-algo", "sha256"])
    w = _checked(stack, None)
    assert w["hash_parity"].startswith("not predictable: "), w["hash_parity"]
    assert "'sha256'" in w["hash_parity"] and "sha256_cbor" in w["hash_parity"]
    hashes = w["engine_hashes"]
    assert hashes["algorithm"] == "sha256" and len(hashes["published"]) >= 1
    assert w["parity"] == "ok"
