"""A replica joining a fleet from a peer's snapshot (issue 16 §4): time to `/ready` 200.

    python -m benchmarks.state.bench_cold_start [--engines 8] [--blocks 1000000] \\
        [--runs 5] [--buffer-steps 64] [--json out.json]

Set-up, all real processes on 127.0.0.1: one `quillcache engine-sim --engines N`
process (N engines, each with its own HTTP port, KV cache and KV-event sockets; a
replay buffer of `--buffer-steps` batches, vLLM's `buffer_steps`, far shorter than the
history) and a peer gateway subscribed to all of them. The peer's index is filled the
way production fills it: completions sent straight to the engines (8,192-token
prompts of distinct bytes, 512 blocks each, spread evenly over the engines), whose
BlockStored events reach the peer over ZMQ and go through its applier; the fill ends
once the peer's index holds `--blocks` blocks.

Then, `--runs` times, a joining replica is started (`quillcache gateway
--bootstrap-from <peer>` with the same engines) and measured:

- *time to ready*: from just before its process is spawned to the first `GET /ready`
  that answers 200 (the port opens once start-up, the bootstrap included, is done; the
  ready file is polled every 2 ms and `/ready` asked as soon as it exists);
- the bootstrap's own phases from its `/ready` body: the snapshot's transfer, its load
  (checksum, header, replay-socket checks of every source, restore), the whole
  bootstrap, and the blocks loaded.

A cold joiner (no bootstrap) is measured alongside: it is ready too, but with what the
engines' short replay buffers still hold. Target: ready <= 2 s with 1 M blocks over 8
engines. Run from the repo root.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from quillcache.gateway.cli import ADMIN_TOKEN_ENV
from quillcache.up import Proc, gateway_args, launch

ADMIN = "bench-admin"
BLOCK = 16
PROMPT_BLOCKS = 512


def engines_args(engines: int, buffer_steps: int, capacity: int) -> list[str]:
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
        "buffer_steps": buffer_steps,
    }
    return [
        "engine-sim",
        "--port",
        "0",
        "--engines",
        str(engines),
        "--model",
        "sim-model",
        "--time-scale",
        "0",
        "--num-gpu-blocks",
        str(capacity),
        "--max-model-len",
        str(PROMPT_BLOCKS * BLOCK + 64),
        "--max-num-seqs",
        "64",
        "--kv-events-config",
        json.dumps(kv),
    ]


def engine_urls(proc: Proc) -> list[str]:
    ready = proc.ready
    if "engines" in ready:
        return [str(e["url"]) for e in ready["engines"]]
    return [str(ready["url"])]


def index_blocks(peer: Proc) -> int:
    r = httpx.get(
        peer.url + "/admin/index", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30.0
    )
    return int(r.json()["blocks"])


def fill(peer: Proc, urls: list[str], blocks: int, concurrency: int) -> float:
    """Completions straight to the engines until the peer's index holds `blocks`."""
    per_prompt = PROMPT_BLOCKS
    prompts = -(-blocks // per_prompt)
    rng = random.Random(16)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
    clients = {u: httpx.Client(base_url=u, timeout=60.0) for u in urls}

    def one(i: int) -> None:
        url = urls[i % len(urls)]
        head = f"[{i:08d}]"
        body = "".join(rng.choice(alphabet) for _ in range(64))
        text = (head + body * (per_prompt * BLOCK // 64 + 1))[: per_prompt * BLOCK]
        r = clients[url].post(
            "/v1/completions", json={"model": "sim-model", "prompt": text, "max_tokens": 1}
        )
        r.raise_for_status()

    t0 = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(prompts)))
    deadline = time.monotonic() + 120
    while index_blocks(peer) < blocks and time.monotonic() < deadline:
        time.sleep(0.2)
    for c in clients.values():
        c.close()
    return time.monotonic() - t0


def join(workdir: Path, urls: list[str], name: str, extra: list[str]) -> dict[str, Any]:
    """Spawn a joiner; the time from spawn to the first /ready 200, and its bootstrap."""
    ready_file = workdir / f"{name}.ready.json"
    log_path = workdir / f"{name}.log"
    ready_file.unlink(missing_ok=True)
    args = gateway_args(urls, extra=["--tokenizer", "builtin", *extra])
    env = {**os.environ, ADMIN_TOKEN_ENV: ADMIN, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        t0 = time.monotonic()
        popen = subprocess.Popen(
            [sys.executable, "-m", "quillcache", *args, "--ready-file", str(ready_file)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        while not ready_file.exists():
            if popen.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"{name} did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.002)
        port_open_s = time.monotonic() - t0
        url = json.loads(ready_file.read_text())["url"]
        with httpx.Client(timeout=10.0) as client:
            while True:
                r = client.get(url + "/ready")
                if r.status_code == 200:
                    break
                if time.monotonic() - t0 > 60:
                    raise RuntimeError(f"{name} not ready: {r.text}")
                time.sleep(0.002)
        ready_s = time.monotonic() - t0
        body = r.json()
        boot = body.get("bootstrap", {})
        return {
            "ready_s": ready_s,
            "port_open_s": port_open_s,
            "bootstrap": {
                k: boot.get(k)
                for k in (
                    "outcome",
                    "blocks_loaded",
                    "bytes",
                    "sources_kept",
                    "sources_dropped",
                    "transfer_s",
                    "load_s",
                    "duration_s",
                )
            },
            "blocks": index_blocks_at(url),
        }
    finally:
        popen.kill()
        popen.wait(timeout=10)


def index_blocks_at(url: str) -> int:
    r = httpx.get(url + "/admin/index", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    return int(r.json()["blocks"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--buffer-steps", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="qc-cold-start-"))
    per_engine = -(-args.blocks // args.engines)
    capacity = per_engine * 2 + PROMPT_BLOCKS * 4  # nothing is evicted during the fill
    procs: list[Proc] = []
    try:
        engines = launch(
            "engines",
            engines_args(args.engines, args.buffer_steps, capacity),
            workdir,
            timeout_s=60,
        )
        procs.append(engines)
        urls = engine_urls(engines)
        os.environ[ADMIN_TOKEN_ENV] = ADMIN
        peer = launch(
            "peer",
            gateway_args(urls, extra=["--tokenizer", "builtin", "--no-parity-check"]),
            workdir,
            timeout_s=60,
        )
        procs.append(peer)
        fill_s = fill(peer, urls, args.blocks, args.concurrency)
        held = index_blocks(peer)
        print(f"peer holds {held} blocks over {len(urls)} engines (fill {fill_s:.1f} s)")
        runs = []
        for i in range(args.runs):
            out = join(workdir, urls, f"joiner{i}", ["--bootstrap-from", peer.url])
            runs.append(out)
            b = out["bootstrap"]
            print(
                f"joiner {i}: ready {out['ready_s']:.3f} s (port open {out['port_open_s']:.3f}"
                f" s); bootstrap {b['outcome']} {b['blocks_loaded']} blocks, "
                f"{b['bytes']} bytes, transfer {b['transfer_s']:.3f} s, load "
                f"{b['load_s']:.3f} s, total {b['duration_s']:.3f} s; "
                f"{b['sources_kept']} sources kept; index {out['blocks']} blocks"
            )
        cold = join(workdir, urls, "cold", [])
        print(f"cold joiner: ready {cold['ready_s']:.3f} s with {cold['blocks']} blocks")
        ready = [r["ready_s"] for r in runs]
        summary = {
            "engines": len(urls),
            "peer_blocks": held,
            "buffer_steps": args.buffer_steps,
            "fill_s": fill_s,
            "ready_s_median": statistics.median(ready),
            "ready_s_max": max(ready),
            "transfer_s_median": statistics.median(r["bootstrap"]["transfer_s"] for r in runs),
            "load_s_median": statistics.median(r["bootstrap"]["load_s"] for r in runs),
            "bootstrap_s_median": statistics.median(r["bootstrap"]["duration_s"] for r in runs),
            "snapshot_bytes": runs[0]["bootstrap"]["bytes"],
            "runs": runs,
            "cold": cold,
            "target_ready_s": 2.0,
        }
        print(
            f"ready median {summary['ready_s_median']:.3f} s, max {summary['ready_s_max']:.3f} s"
            f" (target <= 2 s); transfer median {summary['transfer_s_median']:.3f} s, load "
            f"median {summary['load_s_median']:.3f} s"
        )
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
    finally:
        for p in procs:
            p.kill()


if __name__ == "__main__":
    main()
