"""The grids shipped with the package, by name (`quillcache simulate --matrix quick`).

Each is the TOML text a user would write in a grid file (docs/simulator.md, "The
matrix"), read by the same parser, so a shipped grid is also an example to copy.
"""

from __future__ import annotations

QUICK = """\
description = "every workload, Llama-3.1-8B on an A100, 8 engines, arrivals as recorded"
seeds = 3

[axes]
workloads = ["mooncake", "shared-prefix", "sglang-gsp", "multi-turn", "agent-fanout"]
setups = ["llama-8b-a100"]
engines = [8]
time_scale = [1.0]
"""

FULL = """\
description = "every workload x 3 setups x 4-32 engines x arrival times x0.5, 1, 2"
seeds = 3

[axes]
workloads = ["mooncake", "shared-prefix", "sglang-gsp", "multi-turn", "agent-fanout"]
setups = ["llama-8b-a100", "llama-70b-tp4-h100", "qwen3-32b-fp8-h100"]
engines = [4, 8, 16, 32]
time_scale = [0.5, 1.0, 2.0]
"""

# Cases where cache-aware routers have sent everything to one engine.
DEGENERATE = """\
description = "one shared first block, 2 engines at concurrency 1, a slow engine, a late one"
seeds = 3

[workloads.first-block-only]
# every request shares its first block and nothing after it
generator = "shared-prefix"
requests = 1500
prefix_groups = 1
shared_prefix_blocks = 1
unique_blocks = 160
rate = 30.0

[workloads.light-shared-prefix]
# light enough for two engines that run one sequence at a time
generator = "shared-prefix"
requests = 300
prefix_groups = 8
shared_prefix_blocks = 64
unique_blocks = 8
output_tokens = 64
rate = 1.0

[setups.llama-8b-a100-concurrency-1]
base = "llama-8b-a100"
cost = { "engine.max_num_seqs" = 1 }

[[cells]]
name = "every request shares its first block"
workload = "first-block-only"
setup = "llama-8b-a100"
engines = 8

[[cells]]
name = "the Mooncake trace (block 0 in every request)"
workload = "mooncake"
setup = "llama-8b-a100"
engines = 8

[[cells]]
name = "2 engines at concurrency 1"
workload = "light-shared-prefix"
setup = "llama-8b-a100-concurrency-1"
engines = 2

[[cells]]
name = "one engine 10 times slower"
workload = "shared-prefix"
setup = "llama-8b-a100"
engines = 8
slow_workers = { 0 = 10.0 }

[[cells]]
name = "an engine joins mid-run"
workload = "shared-prefix"
setup = "llama-8b-a100"
engines = 8
join_at_s = { 7 = 25.0 }
"""

NAMED: dict[str, str] = {"quick": QUICK, "full": FULL, "degenerate": DEGENERATE}
