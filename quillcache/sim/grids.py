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

# The policy engine's decisions beside none, with every router (docs/simulator.md,
# "Policies"): what each policy is worth and what it costs, on the shapes its results
# were measured on. Admission cells are judged on the SLO columns: every router
# rejects there, so no TTFT winner is named.
POLICIES = """\
description = "session retention and SLO admission, each beside the same cell without it"
seeds = 3

[workloads.sessions-and-background]
# 30 agent sessions with 30 s tool waits beside 8 one-off 2,048-token prompts a second
generator = "multi-turn"
sessions = 30
turns = 4
system_prompt_len = 64
user_len = 512
think_time_s = 30.0
rate = 1.0
background_rate = 8.0

[workloads.twice-the-load]
# simulate's shared-prefix at 75 requests a second: twice what 4 engines serve
generator = "shared-prefix"
requests = 1500
prefix_groups = 64
shared_prefix_blocks = 128
unique_blocks = 32
zipf = 1.0
rate = 75.0

[setups.llama-8b-a100-3000-blocks]
# caches the background turns over in about 12 s, well within a tool wait
base = "llama-8b-a100"
cost = { "engine.kv_capacity_blocks" = 3000 }

[[cells]]
name = "sessions, no retention"
workload = "sessions-and-background"
setup = "llama-8b-a100-3000-blocks"
engines = 4

[[cells]]
name = "sessions, retention"
workload = "sessions-and-background"
setup = "llama-8b-a100-3000-blocks"
engines = 4
retain = {}

[[cells]]
name = "2x load, 2 s TTFT SLO, no admission"
workload = "twice-the-load"
setup = "llama-8b-a100"
engines = 4
slo = { ttft_s = 2.0, admission = false }

[[cells]]
name = "2x load, 2 s TTFT SLO, admission"
workload = "twice-the-load"
setup = "llama-8b-a100"
engines = 4
slo = { ttft_s = 2.0 }
"""

NAMED: dict[str, str] = {
    "quick": QUICK,
    "full": FULL,
    "degenerate": DEGENERATE,
    "policies": POLICIES,
}
