"""Hot-prefix burst in the simulator, with and without replication (issue 19).

4 engines; background: `bg_rate` requests/s over 64 groups of 2048-token system
prompts; a popular 16k-token system prompt seen at `warm_rate` before the burst (one
engine holds it), then at `burst_rate` for `burst_s` seconds (above one engine's
capacity). Prints, per seed and router, TTFT mean / p99 and the replicas' prefill
tokens as a share of the requests' own.

    python -m benchmarks.sim_replication --seeds 0,1,2 --routers quillcache,preble,llm-d
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from quillcache.costmodel import CostModel, CostModelConfig
from quillcache.sim import generators as g
from quillcache.sim.replicate import ReplicateSettings
from quillcache.sim.runner import SimConfig, run
from quillcache.sim.workload import Workload


def hot_burst(
    *,
    seed: int,
    bg_rate: float = 16.0,
    bg_groups: int = 64,
    bg_prefix_blocks: int = 128,
    hot_prefix_blocks: int = 1024,
    unique_blocks: int = 16,
    output_tokens: int = 128,
    block_size: int = 16,
    duration_s: float = 60.0,
    burst_start_s: float = 15.0,
    burst_s: float = 30.0,
    burst_rate: float = 20.0,
    warm_rate: float = 0.5,
) -> Workload:
    rng = np.random.default_rng(seed)
    bs = block_size
    prompts = [g._tokens(rng, bg_prefix_blocks * bs) for _ in range(bg_groups)]
    hot = g._tokens(rng, hot_prefix_blocks * bs)
    tail = unique_blocks * bs + bs // 2
    items: list[g._Item] = []
    t = np.cumsum(rng.exponential(1 / bg_rate, size=int(bg_rate * duration_s * 1.2)))
    t = t[t < duration_s]
    for ti, gi in zip(t, rng.integers(0, bg_groups, size=len(t)), strict=True):
        tokens = np.concatenate([prompts[gi], g._tokens(rng, tail)])
        items.append(g._Item(float(ti), tokens, output_tokens, f"group-{gi}"))
    burst = burst_start_s + np.cumsum(
        rng.exponential(1 / burst_rate, size=int(burst_rate * burst_s * 1.2))
    )
    burst = burst[burst < burst_start_s + burst_s]
    warm = np.cumsum(rng.exponential(1 / warm_rate, size=int(warm_rate * burst_start_s * 2) + 5))
    for ti in np.concatenate([warm[warm < burst_start_s], burst]):
        tokens = np.concatenate([hot, g._tokens(rng, tail)])
        items.append(g._Item(float(ti), tokens, output_tokens, "hot"))
    return g._finish("hot-burst", items, bs, g.DEFAULT_MODEL, {"seed": seed})


KEPT = ("ttft_mean_s", "ttft_p99_s", "prefill_tokens_computed", "worker_share")
POLICY = ("replications", "replication_prefill_tokens", "replication_prefill_pct")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--routers", default="quillcache")
    p.add_argument("--replicate-opt", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workload-opt", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args()
    opts = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.replicate_opt)}
    wl_opts = {k: json.loads(v) for k, _, v in (o.partition("=") for o in args.workload_opt)}
    settings = ReplicateSettings.parse(opts)
    cost = CostModel(CostModelConfig())
    for seed in [int(s) for s in args.seeds.split(",")]:
        wl = hot_burst(seed=seed, **wl_opts)
        for router in args.routers.split(","):
            row: dict[str, Any] = {"seed": seed, "router": router, "requests": len(wl.requests)}
            for label, rep in (("off", None), ("on", settings)):
                config = SimConfig(workers=4, seed=seed, replicate=rep)
                s = run(wl, router, "native", config, cost).summary()
                row[label] = {k: s[k] for k in (*KEPT, *POLICY) if k in s}
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
