"""`quillcache simulate --list-routers`: one line per policy, aliases said as such."""

from __future__ import annotations

import subprocess
import sys

from quillcache.routing import BUILTIN_ORDER, router_aliases


def test_list_routers_lists_each_policy_once_and_aliases_as_aliases() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--list-routers"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.strip()}
    aliases = router_aliases()
    assert aliases.get("quillcache-greedy") == "mooncake"
    for alias, target in aliases.items():
        assert f"alias of {target}" in lines[alias]
        assert "[" not in lines[alias]  # not a policy of its own (no source of its own)
    policies = [name for name in lines if name not in aliases]
    assert sorted(policies) == sorted(BUILTIN_ORDER)
    assert len(policies) == 11
    assert all("alias of" not in lines[name] for name in policies)
