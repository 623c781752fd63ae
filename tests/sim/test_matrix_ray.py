"""The matrix on Ray (`--ray`): a local Ray instance and a cluster started with `ray
start` give the JSON a local run gives; a failed run is reported with its cell, on Ray
and locally; without Ray installed, `--ray` says what to install."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from quillcache.sim.matrix import Grid, execute, parse_grid, results_json
from tests.sim.test_matrix import TINY, _matrix

ray = pytest.importorskip("ray", reason="the ray extra is not installed")

pytestmark = pytest.mark.timeout(300)


def _broken(grid_text: str) -> Grid:
    """The tiny grid with its second cell made to fail when run (an engine that is not
    in it marked slow: the parser refuses that, the run does too)."""
    grid = parse_grid(grid_text, origin="tiny.toml")
    cells = list(grid.cells)
    cells[1] = dataclasses.replace(cells[1], slow_workers=((9, 2.0),))
    return dataclasses.replace(grid, cells=cells)


def test_a_local_ray_instance_gives_the_local_json(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    local = _matrix("--matrix", "tiny.toml", "--jobs", "1", "--out", "local", cwd=tmp_path)
    on_ray = _matrix(
        "--matrix", "tiny.toml", "--ray", "local", "--jobs", "2", "--out", "ray", cwd=tmp_path
    )
    assert local.returncode == 0, local.stderr
    assert on_ray.returncode == 0, on_ray.stderr
    assert "on Ray (local)" in on_ray.stderr
    assert (tmp_path / "ray" / "matrix.json").read_text() == (
        tmp_path / "local" / "matrix.json"
    ).read_text()
    page = (tmp_path / "ray" / "matrix.md").read_text()
    assert "--ray local" in page and "a local Ray instance" in page


@pytest.mark.parametrize("ray_address", [None, "local"])
def test_a_failed_run_is_reported_with_its_cell(ray_address: str | None) -> None:
    grid = _broken(TINY)
    progress: list[int] = []
    outcome = execute(
        grid,
        jobs=2,
        ray=ray_address,
        progress=lambda done, total: progress.append(done),
    )
    assert progress[-1] == len(outcome.runs) == 8
    assert len(outcome.failures) == 4  # the second cell: 2 seeds x 2 routers
    assert all("slow worker 9" in e or "9 is not one of" in e for e in outcome.failures)
    results = results_json(grid, outcome)
    first, second = results["cells"]
    assert first["mean"]["verdict"] != "failed" and len(first["runs"]) == 4
    assert second["mean"]["verdict"] == "failed" and len(second["failed"]) == 4
    assert results["totals"]["mean"]["failed"] == 1


def test_without_ray_the_message_says_what_to_install(tmp_path: Path) -> None:
    (tmp_path / "tiny.toml").write_text(TINY)
    (tmp_path / "ray.py").write_text("raise ImportError('no ray here')\n")  # shadows it
    proc = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--matrix", "tiny.toml", "--ray", "local"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={
            **os.environ,
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        },
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'quillcache[ray]'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_ray_without_matrix_is_refused(tmp_path: Path) -> None:
    proc = _matrix("--ray", "local", cwd=tmp_path)
    assert proc.returncode == 2 and "--ray needs --matrix" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ray_cluster() -> Iterator[tuple[str, dict[str, str]]]:
    """A one-node cluster started as an operator would (`ray start --head`), with
    Ray's token authentication (the token given to it and to its clients in the
    environment, as Ray's docs say), stopped with its process group. Its directory is
    short: Ray's Unix sockets live there."""
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    exe = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    port = _free_port()
    temp = Path(tempfile.mkdtemp(prefix="qcray", dir="/tmp"))
    proc = subprocess.Popen(
        [exe, "start", "--head", "--block", "--num-cpus", "2", "--port", str(port),
         "--node-ip-address", "127.0.0.1", "--include-dashboard", "false",
         "--temp-dir", str(temp)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, **auth},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail("ray start --head did not listen within 60 s")
        yield f"127.0.0.1:{port}", auth
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(temp, ignore_errors=True)


def test_a_cluster_by_address_gives_the_local_json(
    tmp_path: Path, ray_cluster: tuple[str, dict[str, str]]
) -> None:
    address, auth = ray_cluster
    (tmp_path / "tiny.toml").write_text(TINY)
    local = _matrix("--matrix", "tiny.toml", "--jobs", "1", "--out", "local", cwd=tmp_path)
    on_ray = subprocess.run(
        [sys.executable, "-m", "quillcache", "simulate", "--no-progress", "--matrix",
         "tiny.toml", "--ray", address, "--out", "ray"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, **auth},
    )  # fmt: skip
    assert local.returncode == 0, local.stderr
    assert on_ray.returncode == 0, on_ray.stderr
    assert json.loads((tmp_path / "ray" / "matrix.json").read_text()) == json.loads(
        (tmp_path / "local" / "matrix.json").read_text()
    )
    assert f"the Ray cluster at {address}" in (tmp_path / "ray" / "matrix.md").read_text()
