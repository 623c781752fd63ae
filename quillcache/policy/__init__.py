"""The policy engine's decisions: what to keep warm, where, and within which budget.

Pure parts, shared by the gateway (which acts on engines: `gateway/actuator.py`,
`gateway/policy_loop.py`) and the simulator: the retention targets and their store
(`targets`), token budgets (`budget`), when a holder needs touching (`retention`), and
hot-prefix replication (`heat`, `replication`, and `hot`: the tokens of hot prefixes).
See docs/policy.md.
"""
