"""What tests/deploy checks share: the deploy/ files parsed, and the image's software
without Docker: the project's wheel installed in a fresh venv by the script the
image's runtime stage runs (deploy/install-wheel.sh)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
# `make test` builds the wheel before pytest and names its directory here; the same
# file is then smoke-tested by scripts/wheel-smoke.sh
WHEEL_DIR_ENV = "QUILLCACHE_WHEEL_DIR"


# -- the Dockerfile ------------------------------------------------------------------


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, rest)

    def all(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]

    def exec_form(self, keyword: str) -> list[str]:
        """The last ENTRYPOINT / CMD of the stage, which must be in JSON (exec) form."""
        values = self.all(keyword)
        assert values, f"no {keyword} in the stage FROM {self.base}"
        parsed = json.loads(values[-1])
        assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed), values[-1]
        return parsed

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for rest in self.all("ENV"):
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"ENV {rest!r}: use the KEY=VALUE form"
                out[key] = value
        return out


def dockerfile_stages(text: str) -> list[Stage]:
    """The Dockerfile's stages: continuation lines joined, comments and pragmas skipped."""
    logical: list[str] = []
    buf = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        logical.append(buf + stripped)
        buf = ""
    assert not buf, "the Dockerfile ends inside a continued line"
    stages: list[Stage] = []
    for instruction in logical:
        keyword, _, rest = instruction.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif keyword == "ARG" and not stages:
            continue
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest.strip()))
    return stages


# -- Kubernetes manifests ------------------------------------------------------------


def manifests() -> list[tuple[Path, dict[str, Any]]]:
    """Every object in deploy/k8s/*.yaml, with its file."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                out.append((path, doc))
    return out


def find(kind: str, name: str) -> dict[str, Any]:
    found = [d for _, d in manifests() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} objects in deploy/k8s"
    return found[0]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def container(workload: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return dict(found)


def gateway_config_text() -> str:
    return str(find("ConfigMap", "quillcache-gateway")["data"]["gateway.yaml"])


# -- the wheel and the image's venv --------------------------------------------------


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel `make wheel` builds (what CI's wheel smoke test and the image install):
    the one `make test` built (`QUILLCACHE_WHEEL_DIR`), else built now the same way."""
    where = os.environ.get(WHEEL_DIR_ENV)
    if not where:
        out = tmp_path_factory.mktemp("wheel")
        subprocess.run(
            ["make", "-s", "wheel", f"WHEEL_DIR={out}"], cwd=ROOT, check=True, timeout=3600
        )
        where = str(out)
    wheels = sorted(Path(where).glob("quillcache-*.whl"))
    assert len(wheels) == 1, f"{WHEEL_DIR_ENV}={where}: expected one quillcache wheel, {wheels}"
    return wheels[0]


@pytest.fixture(scope="session")
def image_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel, made by the image's own install step."""
    venv = tmp_path_factory.mktemp("image") / "opt-quillcache"
    subprocess.run(
        [
            "sh",
            str(DEPLOY / "install-wheel.sh"),
            str(venv),
            str(wheel),
            str(ROOT / "requirements-dev.lock"),
        ],
        env={**os.environ, "PYTHON": sys.executable},
        check=True,
        timeout=1200,
    )
    return venv
