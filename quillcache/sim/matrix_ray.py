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
from quillcache.sim.matrix import Task, TaskResult

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


def _run_tasks(state: dict[str, Any], tasks: list[Task], version: str) -> list[TaskResult]:
    """What each Ray task runs: a batch of the grid's tasks, in this worker process."""
    from quillcache.sim.matrix import install_state, run_task_guarded

    mine = _version()
    if mine != version:
        message = f"this node has QuillCache {mine}, the driver {version}: install the same"
        return [(None, 0.0, message) for _ in tasks]
    install_state(state)
    return [run_task_guarded(t) for t in tasks]


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
    todo: list[tuple[int, Task]],
    address: str,
    jobs: int,
    finish: Callable[[int, TaskResult], None],
) -> tuple[str, int]:
    """Every task of `todo` (task index, task) on the cluster `address` names
    (`RAY_HELP`), each result handed to `finish` with its index as it comes back;
    where they ran and the cluster's CPUs."""
    if not address:
        raise ConfigError(f"--ray needs a value: {RAY_HELP}")
    ray = _ray()
    if ray.is_initialized():
        raise ConfigError("--ray: this process is already connected to a Ray cluster")
    where = _connect(ray, address, jobs)
    try:
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)))
        remote = ray.remote(num_cpus=1, max_retries=0)(_run_tasks)
        shared = ray.put(state)
        version = _version()
        # One task per (cell, seed): its routers share the cell's workload, which a
        # worker builds once (`matrix._workload_for` keeps the last one).
        batches: list[list[tuple[int, Task]]] = []
        for item in todo:
            if batches and batches[-1][0][1][:2] == item[1][:2]:
                batches[-1].append(item)
            else:
                batches.append([item])
        pending = {
            remote.remote(shared, [t for _, t in batch], version): batch for batch in batches
        }
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                batch = pending.pop(ref)
                try:
                    got: list[TaskResult] = ray.get(ref)
                except Exception as exc:  # the task's worker died, or Ray lost it
                    got = [(None, 0.0, _describe(exc, state, t)) for _, t in batch]
                for (i, _), result in zip(batch, got, strict=True):
                    finish(i, result)
        return where, cpus
    finally:
        ray.shutdown()


def _describe(exc: BaseException, state: dict[str, Any], task: Task) -> str:
    ci, seed, router = task
    name = state["grid"].cells[ci].name
    return f"cell {name!r}, seed {seed}, router {router}: Ray: {type(exc).__name__}: {exc}"
