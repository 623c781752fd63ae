"""deploy/Dockerfile: hadolint at its strictest threshold, and the shape the rest of
deploy/ relies on (a build stage making the wheel with `make wheel`, a runtime stage
installing it with deploy/install-wheel.sh, `quillcache` as the entrypoint)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quillcache.cli import SUBCOMMANDS, build_parser
from tests.deploy.conftest import DEPLOY, DOCKERFILE, dockerfile_stages

# the one rule the Dockerfile silences, each time with a reason next to it: Debian's
# point releases replace package versions, so pinned apt versions break rebuilds
ALLOWED_PRAGMAS = {"DL3008"}


def hadolint(path: Path, *extra: str) -> tuple[int, list[dict[str, object]]]:
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    proc = subprocess.run(
        [exe, "--no-color", "--format", "json", "--failure-threshold", "style", *extra, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip(), f"hadolint printed nothing: {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def test_hadolint_finds_nothing_at_any_level() -> None:
    code, findings = hadolint(DOCKERFILE)
    assert findings == [] and code == 0, findings


def test_hadolint_pragmas_hide_only_the_documented_rule() -> None:
    pragmas = re.findall(r"#\s*hadolint ignore=([\w,]+)", DOCKERFILE.read_text())
    assert {rule for p in pragmas for rule in p.split(",")} <= ALLOWED_PRAGMAS
    _, findings = hadolint(DOCKERFILE, "--disable-ignore-pragma")
    assert {f["code"] for f in findings} <= ALLOWED_PRAGMAS, findings


def test_hadolint_reports_a_broken_copy(tmp_path: Path) -> None:
    """The linter reads this Dockerfile for real: an untagged base image and an apt
    install with its recommended packages, in a copy of it, are reported."""
    text = DOCKERFILE.read_text()
    broken = re.sub(r"^FROM python:\S+", "FROM python", text, count=1, flags=re.M)
    broken = broken.replace("apt-get install -y --no-install-recommends", "apt-get install -y")
    assert broken != text
    copy = tmp_path / "Dockerfile"
    copy.write_text(broken)
    code, findings = hadolint(copy)
    assert code != 0 and {"DL3006", "DL3015"} <= {f["code"] for f in findings}, findings


def test_two_stages_the_wheel_built_by_make_and_installed_by_the_shared_script() -> None:
    build, runtime = dockerfile_stages(DOCKERFILE.read_text())
    assert build.name == "build" and runtime.name == "runtime"
    # the build stage makes the wheel the way CI does (Makefile `wheel`)
    assert any(re.search(r"\bmake wheel WHEEL_DIR=/dist\b", r) for r in build.all("RUN"))
    # the runtime stage has no toolchain: only the wheel from the build stage
    assert runtime.base.startswith("python:3.11-slim")
    assert "--from=build /dist/ /tmp/dist/" in runtime.all("COPY")
    install = [r for r in runtime.all("RUN") if "install-wheel.sh" in r]
    assert install and "/opt/quillcache /tmp/dist/quillcache-*.whl" in install[0]
    assert "deploy/install-wheel.sh requirements-dev.lock /tmp/" in runtime.all("COPY")
    assert (DEPLOY / "install-wheel.sh").exists()
    assert runtime.env()["PATH"].startswith("/opt/quillcache/bin:")
    user = runtime.all("USER")
    assert user and not user[-1].startswith(("root", "0")), "the image runs as root"


def test_the_entrypoint_and_default_command_parse_with_todays_cli() -> None:
    runtime = dockerfile_stages(DOCKERFILE.read_text())[-1]
    assert runtime.exec_form("ENTRYPOINT") == ["quillcache"]
    cmd = runtime.exec_form("CMD")
    assert cmd[0] in SUBCOMMANDS
    try:
        args = build_parser().parse_args(cmd)
    except SystemExit as exc:  # argparse's way of refusing a flag
        pytest.fail(f"quillcache refuses the image's CMD {cmd}: exit {exc.code}")
    assert (args.command, args.host, args.port) == ("gateway", "0.0.0.0", 8000)


def test_a_workflow_builds_and_pushes_this_dockerfile() -> None:
    """The image is built where Docker is (.github/workflows/image.yml): the workflow
    parses, builds deploy/Dockerfile from the repository root, tries the image, and
    pushes only outside pull requests."""
    workflow = yaml.safe_load((DEPLOY.parent / ".github" / "workflows" / "image.yml").read_text())
    steps = workflow["jobs"]["image"]["steps"]
    builds = [s for s in steps if str(s.get("uses", "")).startswith("docker/build-push-action")]
    assert builds and all(
        s["with"]["file"] == "deploy/Dockerfile" and s["with"]["context"] == "." for s in builds
    )
    pushes = [s for s in builds if s["with"].get("push")]
    assert pushes and all(s["if"] == "github.event_name != 'pull_request'" for s in pushes)
    smoke = [s for s in steps if "/ready" in s.get("run", "")]
    assert smoke, "no step tries the built image"
