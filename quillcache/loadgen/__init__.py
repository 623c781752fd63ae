"""`quillcache loadgen`: replay a workload against any OpenAI endpoint and measure it.

- `workload`: synthetic shared-prefix prompts, or a Mooncake-format trace.
- `runner`: the asyncio client (httpx), concurrency- or rate-driven, streaming or not.
- `report`: latency percentiles, throughput, errors; rich table and JSON.
- `cli`: the subcommand.
"""

from __future__ import annotations
