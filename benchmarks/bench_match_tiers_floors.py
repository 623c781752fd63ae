"""`match_tiers` with the floors placed by a walk over the index's sources
(`all_live=False`) against `all_live=True`, alternated in one process on
`quillcache bench-route`'s fleet; per call, p50 / p99 µs, and the results checked equal.

    python benchmarks/bench_match_tiers_floors.py --engines 16,256,1024
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from quillcache.bench.route_cli import build_fleet
from quillcache.controlplane import ControlPlane
from quillcache.index.native import NativeIndex


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="16,256,1024")
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print("| engines | walk over the sources | all_live |")
    print("|---|---|---|")
    for n in (int(x) for x in args.engines.split(",")):
        fleet = build_fleet(n, 4, args.requests, 0)
        cp = ControlPlane(index="native", router="round-robin", block_size=16)
        for e in range(n):
            cp.add_worker(e)
            cp.ingest(e, fleet.stored[e])
        cand = cp._candidates(None)
        table = cand.table
        assert table is not None
        index = cp.index
        assert isinstance(index, NativeIndex)
        native = index._inner  # the binding itself: no wrapper cost in the figure
        samples: dict[bool, list[int]] = {False: [], True: []}
        for _ in range(args.rounds):
            for live in (False, True):
                for keys, _, _ in fleet.requests:
                    t = time.perf_counter_ns()
                    native.match_tiers(keys, table, n, cand.rank_counts, all_live=live)
                    samples[live].append(time.perf_counter_ns() - t)
        for keys, _, _ in fleet.requests:
            walk = native.match_tiers(keys, table, n, cand.rank_counts, all_live=False)
            fill = native.match_tiers(keys, table, n, cand.rank_counts, all_live=True)
            if walk[0].tolist() != fill[0].tolist() or walk[2] != fill[2]:
                raise SystemExit(f"different tiers at {n} engines")
        cp.close()

        def cell(x: list[int]) -> str:
            p50, p99 = np.percentile(x, [50, 99]) / 1e3
            return f"{p50:.2f} / {p99:.2f}"

        print(f"| {n} | {cell(samples[False])} | {cell(samples[True])} |")


if __name__ == "__main__":
    main()
