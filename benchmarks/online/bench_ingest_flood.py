"""The gateway's memory and recovery under a KV-event flood (issue: ingest under overload).

    python -m benchmarks.online.bench_ingest_flood [--blocks-per-s 2000000] [--seconds 15]

Real processes on 127.0.0.1: `--engines` engine simulators (vLLM's replay buffer of
10,000 batches each) flooding the gateway at once with BlockStored/BlockRemoved batches
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


_COUNTED = (
    "restarts",
    "stale_marks",
    "dropped",
    "gaps",
    "replays",
    "replayed_batches",
    "received",
    "applied_batches",
)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def sources_of(gw_url: str) -> list[dict[str, Any]]:
    index = httpx.get(
        gw_url + "/admin/index", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30
    ).json()
    sources: list[dict[str, Any]] = sorted(index["event_sources"], key=lambda s: s["worker"])
    return sources


def flooding(urls: list[str]) -> bool:
    return any(httpx.get(u + "/debug/flood", timeout=10).json()["running"] for u in urls)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks-per-s", type=float, default=2_000_000, help="flood rate asked")
    ap.add_argument("--seconds", type=float, default=15.0, help="flood length")
    ap.add_argument("--batch-blocks", type=int, default=256, help="blocks per flood batch")
    ap.add_argument("--after-s", type=float, default=30.0, help="watch this long after")
    ap.add_argument("--engines", type=int, default=1, help="engine simulators flooding at once")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="qc-flood-") as d:
        wd = Path(d)
        engines = [
            launch(f"engine{i}", engine_args(time_scale=0.0), wd) for i in range(args.engines)
        ]
        urls = [e.url for e in engines]
        cfg = wd / "gw.json"
        settings = {
            "admin_token": ADMIN,
            "tokenizer": "builtin",
            "parity_check": False,
            "secret_file": str(wd / "secret.json"),
        }
        cfg.write_text(json.dumps(settings))
        gw = launch("gateway", gateway_args(urls, extra=["--config", str(cfg)]), wd)
        try:
            time.sleep(2.0)  # subscribed, start-up replay done
            pid = gw.popen.pid
            baseline = rss_mib(pid)
            flood = {
                "blocks_per_s": args.blocks_per_s,
                "seconds": args.seconds,
                "batch_blocks": args.batch_blocks,
            }
            for url in urls:
                started = httpx.post(url + "/debug/flood", json=flood, timeout=10)
                assert started.status_code == 202, started.text
            peak, t0 = baseline, time.monotonic()
            while flooding(urls):
                peak = max(peak, rss_mib(pid))
                time.sleep(0.2)
            last_frame = time.monotonic()
            ends = [httpx.get(u + "/debug/flood", timeout=10).json() for u in urls]
            caught_up_after: float | None = None
            after = baseline
            while time.monotonic() - last_frame < args.after_s:
                after = rss_mib(pid)
                peak = max(peak, after)
                seqs = [s["last_seq"] for s in sources_of(gw.url)]
                if caught_up_after is None and seqs == [e["last_seq"] for e in ends]:
                    caught_up_after = time.monotonic() - last_frame
                time.sleep(0.2)
            srcs = sources_of(gw.url)
            report = {
                "engines": args.engines,
                "flood_s": round(last_frame - t0, 1),
                "published_blocks": sum(e["published_blocks"] for e in ends),
                "applied_through_engines_last_seq_after_s": caught_up_after,
                "rss_baseline_mib": round(baseline, 1),
                "rss_peak_over_baseline_mib": round(peak - baseline, 1),
                "rss_after_over_baseline_mib": round(after - baseline, 1),
                "after_s": args.after_s,
                **{k: sum(s[k] for s in srcs) for k in _COUNTED},
            }
            print(json.dumps(report))
        finally:
            gw.kill()
            for e in engines:
                e.kill()


if __name__ == "__main__":
    main()
