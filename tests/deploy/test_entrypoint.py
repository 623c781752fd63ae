"""The image's commands, run without Docker: the project's wheel in a fresh venv made
by the image's own install step (deploy/install-wheel.sh), outside the source tree,
then the Dockerfile's ENTRYPOINT + CMD, and the commands, config and probes of the
Kubernetes manifests, each with only its addresses moved to free ports on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.deploy.conftest import (
    DOCKERFILE,
    container,
    dockerfile_stages,
    find,
    gateway_config_text,
)
from tests.online.helpers import free_port, wait_for

VENV_IN_IMAGE = "/opt/quillcache"  # where the Dockerfile installs (checked in test_dockerfile)
pytestmark = pytest.mark.timeout(3600)  # the first run may build the wheel (RocksDB)


class Processes:
    def __init__(self, venv: Path, workdir: Path) -> None:
        self.venv = venv
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        runtime = dockerfile_stages(DOCKERFILE.read_text())[-1]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        # the image's ENV, its venv path mapped to ours
        for key, value in runtime.env().items():
            value = value.replace(VENV_IN_IMAGE, str(venv)).replace("$PATH", env["PATH"])
            env[key] = value
        env["QUILLCACHE_STATE_DIR"] = str(workdir / "state")
        self.env = env

    def run(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Path:
        """`quillcache argv...` as the image's entrypoint runs it; returns its log."""
        entrypoint = dockerfile_stages(DOCKERFILE.read_text())[-1].exec_form("ENTRYPOINT")
        exe = self.venv / "bin" / entrypoint[0]
        assert exe.exists(), f"the wheel installed no {entrypoint[0]} console script"
        log = self.workdir / f"{name}.log"
        with open(log, "wb") as out:
            self.procs.append(
                subprocess.Popen(
                    [str(exe), *entrypoint[1:], *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=self.workdir,  # not the checkout: the venv's package is imported
                    env={**self.env, **(env or {})},
                )
            )
        return log

    def wait_http(self, url: str, log: Path, timeout_s: float = 60.0) -> None:
        proc = self.procs[-1]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        pytest.fail(f"{url} not 200 in {timeout_s}s:\n{log.read_text()[-3000:]}")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)


@pytest.fixture
def procs(image_venv: Path, tmp_path: Path) -> Iterator[Processes]:
    p = Processes(image_venv, tmp_path)
    try:
        yield p
    finally:
        p.close()


def with_value(argv: list[str], flag: str, value: str) -> list[str]:
    """`argv` with the value after `flag` replaced (the flag must be there)."""
    assert flag in argv, f"{flag} not in {argv}"
    out = list(argv)
    out[out.index(flag) + 1] = value
    return out


def test_the_venv_runs_the_wheels_package_not_the_checkout(
    image_venv: Path, wheel: Path, tmp_path: Path
) -> None:
    where = subprocess.run(
        [str(image_venv / "bin" / "python"), "-c", "import quillcache; print(quillcache.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if not k.startswith("PYTHON")},
        check=True,
    ).stdout.strip()
    assert where.startswith(str(image_venv)), where
    version = subprocess.run(
        [str(image_venv / "bin" / "quillcache"), "--version"], capture_output=True, text=True
    ).stdout.split()
    assert version[-1] == wheel.name.split("-")[1]


def test_the_default_command_serves_health_and_ready(procs: Processes) -> None:
    """ENTRYPOINT + CMD: a gateway with no engine yet is alive (/health 200) and not
    ready (/ready 503 saying there is no engine)."""
    cmd = dockerfile_stages(DOCKERFILE.read_text())[-1].exec_form("CMD")
    port = free_port()
    argv = with_value(with_value(cmd, "--host", "127.0.0.1"), "--port", str(port))
    url = f"http://127.0.0.1:{port}"
    log = procs.run("gateway", argv)
    procs.wait_http(url + "/health", log)
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    ready = httpx.get(url + "/ready")
    assert ready.status_code == 503
    assert ready.json()["missing"] == ["no routable engine: no engine configured"]


def test_the_kubernetes_commands_config_and_probes(procs: Processes, tmp_path: Path) -> None:
    """The engines' StatefulSet command, then the gateway Deployment's command with its
    ConfigMap's config, the secret made as docs/deploy.md says and the admin token from
    the environment: started by the startup probe's path, ready by the readiness
    probe's, and a completion routed to an engine."""
    engines = find("StatefulSet", "quillcache-engine")
    engine_args = [str(a) for a in container(engines, "engine")["args"]]
    engine_urls = []
    for i in range(engines["spec"]["replicas"]):
        kv = json.loads(engine_args[engine_args.index("--kv-events-config") + 1])
        assert kv["endpoint"] == "tcp://*:5557" and kv["replay_endpoint"] == "tcp://*:5558"
        kv.update(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
        port = free_port()
        argv = with_value(engine_args, "--host", "127.0.0.1")
        argv = with_value(
            with_value(argv, "--port", str(port)), "--kv-events-config", json.dumps(kv)
        )
        url = f"http://127.0.0.1:{port}"
        log = procs.run(f"engine{i}", argv)
        procs.wait_http(
            url + container(engines, "engine")["readinessProbe"]["httpGet"]["path"], log
        )
        engine_urls.append(url)

    deployment = find("Deployment", "quillcache-gateway")
    gateway = container(deployment, "gateway")
    config = yaml.safe_load(gateway_config_text())
    assert len(config["workers"]) == len(engine_urls)
    secret = tmp_path / "gateway-secret.json"
    made = subprocess.run(
        [str(procs.venv / "bin" / "quillcache"), "secret", "show", "--file", str(secret)],
        capture_output=True,
        text=True,
        env=procs.env,
    )
    assert made.returncode == 0 and secret.exists(), made.stderr
    port = free_port()
    config.update(
        host="127.0.0.1",
        port=port,
        workers=[{**w, "url": u} for w, u in zip(config["workers"], engine_urls, strict=True)],
        secret_file=str(secret),
    )
    config_file = tmp_path / "gateway.yaml"
    config_file.write_text(yaml.safe_dump(config))
    argv = [str(a) for a in gateway["args"]]
    argv = with_value(argv, "--config", str(config_file))
    (token_env,) = [e for e in gateway["env"] if e["name"] == "QUILLCACHE_ADMIN_TOKEN"]
    url = f"http://127.0.0.1:{port}"
    log = procs.run("gateway", argv, env={token_env["name"]: "k8s-admin-token"})

    probes = {p: gateway[p]["httpGet"]["path"] for p in ("startupProbe", "readinessProbe")}
    procs.wait_http(url + probes["startupProbe"], log)
    wait_for(
        lambda: httpx.get(url + probes["readinessProbe"], timeout=5).status_code == 200,
        timeout=30,
        what="the readiness probe's path answering 200",
    )
    assert httpx.get(url + gateway["livenessProbe"]["httpGet"]["path"]).status_code == 200
    ready = httpx.get(url + "/ready").json()
    assert ready["sources"] == {"total": len(engine_urls), "caught_up": len(engine_urls)}
    answer = httpx.post(
        url + "/v1/completions",
        json={"model": "sim-model", "prompt": "hello from the manifests", "max_tokens": 3},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-quillcache-worker"] in {str(i) for i in range(len(engine_urls))}
    workers = httpx.get(
        url + "/admin/workers", headers={"authorization": "Bearer k8s-admin-token"}, timeout=10
    )
    assert workers.status_code == 200 and len(workers.json()["workers"]) == len(engine_urls)
