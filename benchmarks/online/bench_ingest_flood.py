"""The gateway's memory and recovery under a KV-event flood (issue: ingest under overload).

    python -m benchmarks.online.bench_ingest_flood [--blocks-per-s 2000000] [--seconds 15]

Real processes on 127.0.0.1: one engine simulator (drained: events only, vLLM's replay
buffer of 10,000 batches) flooding the gateway with BlockStored/BlockRemoved batches
(`POST /debug/flood`), and a gateway with its default event settings. The gateway's
resident memory (VmRSS from /proc) is sampled every 0.2 s: its baseline before the
flood, the peak during it, and 30 s after the last frame; the gateway's own counters
(`/admin/index`) say whether it counted a restart, marked the source stale, and how far
its applied sequence got. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from quillcache.up import engine_args, gateway_args, launch

ADMIN = "bench"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def source_of(gw_url: str) -> dict[str, Any]:
    index = httpx.get(
        gw_url + "/admin/index", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    ).json()
    source: dict[str, Any] = index["event_sources"][0]
    return source


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-per-s", type=float, default=2_000_000, help="flood rate asked")
    ap.add_argument("--seconds", type=float, default=15.0, help="flood length")
    ap.add_argument("--batch-blocks", type=int, default=256, help="blocks per flood batch")
    ap.add_argument("--after-s", type=float, default=30.0, help="watch this long after")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qc-flood-") as d:
        wd = Path(d)
        engine = launch("engine", engine_args(time_scale=0.0), wd)
        cfg = wd / "gw.json"
        cfg.write_text(
            json.dumps(
                {
                    "admin_token": ADMIN,
                    "tokenizer": "builtin",
                    "parity_check": False,
                    "secret_file": str(wd / "secret.json"),
                }
            )
        )
        gw = launch("gateway", gateway_args([engine.url], extra=["--config", str(cfg)]), wd)
        try:
            time.sleep(2.0)  # subscribed, start-up replay done
            pid = gw.popen.pid
            baseline = rss_mib(pid)
            flood = {
                "blocks_per_s": args.blocks_per_s,
                "seconds": args.seconds,
                "batch_blocks": args.batch_blocks,
            }
            started = httpx.post(engine.url + "/debug/flood", json=flood, timeout=10)
            assert started.status_code == 202, started.text
            peak, t0 = baseline, time.monotonic()
            while httpx.get(engine.url + "/debug/flood", timeout=10).json()["running"]:
                peak = max(peak, rss_mib(pid))
                time.sleep(0.2)
            last_frame = time.monotonic()
            published = httpx.get(engine.url + "/debug/flood", timeout=10).json()
            samples = []
            while time.monotonic() - last_frame < args.after_s:
                peak = max(peak, rss_mib(pid))
                samples.append((time.monotonic() - last_frame, rss_mib(pid)))
                time.sleep(0.2)
            src = source_of(gw.url)
            print(
                json.dumps(
                    {
                        "flood_s": round(last_frame - t0, 1),
                        "published_blocks": published["published_blocks"],
                        "rss_baseline_mib": round(baseline, 1),
                        "rss_peak_over_baseline_mib": round(peak - baseline, 1),
                        "rss_after_over_baseline_mib": round(samples[-1][1] - baseline, 1),
                        "after_s": args.after_s,
                        "restarts": src["restarts"],
                        "stale_marks": src["stale_marks"],
                        "dropped": src["dropped"],
                        "gaps": src["gaps"],
                        "replays": src["replays"],
                        "replayed_batches": src["replayed_batches"],
                        "received": src["received"],
                        "applied_batches": src["applied_batches"],
                        "last_seq": src["last_seq"],
                    }
                )
            )
        finally:
            gw.kill()
            engine.kill()


if __name__ == "__main__":
    main()
