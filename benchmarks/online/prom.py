"""Reading a Prometheus text page in the online benchmarks."""

from __future__ import annotations


def metric(page: str, name: str) -> float:
    """Sum of every sample of one metric; `name` may carry the first labels of its
    samples (`quillcache_policy_warm_requests_total{action="replicate"`): those samples
    only."""
    total = 0.0
    labelled = "{" in name
    for line in page.splitlines():
        if line.startswith(name) and (labelled or line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total
