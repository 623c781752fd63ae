"""A matrix's runs on a Ray cluster (`quillcache simulate --matrix GRID --ray ...`).

The runs are independent and deterministic for their seed, so a grid that outgrows one
machine spreads over a cluster cell by cell and gives the JSON a local run gives: each
task is one Ray task (one CPU), the grid and the traces it reads go to the object store
once, results are put back in task order, and progress moves as tasks finish, in any
order. A task that fails (an error in its run, a worker that died) is reported with
its cell and its error, never left out.

Every node needs the same QuillCache installed (`pip install 'quillcache[ray]'`): a
task run by another version is refused with both versions named, since its numbers
would not be comparable.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from quillcache.errors import ConfigError
from quillcache.sim.matrix import Task, TaskResult, Unit

RAY_HELP = (
    "local (start a Ray instance on this machine for the run, --jobs CPUs), auto (the "
    "cluster this machine belongs to, as `ray start` left it), or a cluster's address "
    "(HOST:PORT of its head, or ray://HOST:10001)"
)


def _version() -> str:
    try:
        return importlib.metadata.version("quillcache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _run_units(
    state: dict[str, Any], units: list[Unit], version: str
) -> list[tuple[int, TaskResult]]:
    """What each Ray task runs: a batch of the grid's units, in this worker process."""
    from quillcache.sim.matrix import install_state, run_unit

    mine = _version()
    if mine != version:
        message = f"this node has QuillCache {mine}, the driver {version}: install the same"
        return [(i, (None, 0.0, message)) for unit in units for i, _ in unit]
    install_state(state)
    return [item for unit in units for item in run_unit(unit)]


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray, which is not installed: pip install 'quillcache[ray]'"
        ) from None
    return ray


def _connect(ray: Any, address: str, jobs: int) -> str:
    """Start or join the cluster; the address it runs on, for the page."""
    quiet = {"log_to_driver": False, "configure_logging": False}
    try:
        if address == "local":
            ray.init(num_cpus=jobs, include_dashboard=False, **quiet)
            return "a local Ray instance"
        ray.init(address=address, **quiet)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--ray {address}: cannot reach the Ray cluster: {exc}") from None
    return f"the Ray cluster at {address}"


def run_on_ray(
    state: dict[str, Any],
    units: list[Unit],
    address: str,
    jobs: int,
    finish: Callable[[int, TaskResult], None],
) -> tuple[str, int]:
    """Every unit (`matrix.units_of`) on the cluster `address` names (`RAY_HELP`), each
    result handed to `finish` with its task index as it comes back; where they ran and
    the cluster's CPUs."""
    if not address:
        raise ConfigError(f"--ray needs a value: {RAY_HELP}")
    ray = _ray()
    if ray.is_initialized():
        raise ConfigError("--ray: this process is already connected to a Ray cluster")
    where = _connect(ray, address, jobs)
    try:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        remote = ray.remote(num_cpus=1, max_retries=0)(_run_units)
        shared = ray.put(state)
        version = _version()
        # One Ray task per (cell, first seed): its routers share the cell's workload,
        # which a worker builds once (`matrix._workload_for` keeps the last one).
        batches: list[list[Unit]] = []
        for unit in units:
            if batches and batches[-1][0][0][1][:2] == unit[0][1][:2]:
                batches[-1].append(unit)
            else:
                batches.append([unit])
        pending = {remote.remote(shared, batch, version): batch for batch in batches}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                batch = pending.pop(ref)
                try:
                    got: list[tuple[int, TaskResult]] = ray.get(ref)
                except Exception as exc:  # the task's worker died, or Ray lost it
                    got = [
                        (i, (None, 0.0, _describe(exc, state, t)))
                        for unit in batch
                        for i, t in unit
                    ]
                for i, result in got:
                    finish(i, result)
        return where, cpus
    finally:
        ray.shutdown()


def _describe(exc: BaseException, state: dict[str, Any], task: Task) -> str:
    ci, seed, router = task
    name = state["grid"].cells[ci].name
    return f"cell {name!r}, seed {seed}, router {router}: Ray: {type(exc).__name__}: {exc}"
