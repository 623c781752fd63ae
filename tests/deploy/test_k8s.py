"""deploy/k8s/: every object valid against Kubernetes' own schemas (kubernetes-validate,
strict: unknown fields are errors), probes wired to the gateway's /ready and /health,
services selecting their pods, and every quillcache command and config accepted by
today's CLI and config model (no flag that does not exist yet)."""

from __future__ import annotations

import argparse
import copy
import importlib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from quillcache.cli import SUBCOMMANDS, build_parser
from quillcache.gateway.config import load_config
from tests.deploy.conftest import (
    DOCKERFILE,
    container,
    dockerfile_stages,
    find,
    gateway_config_text,
    manifests,
    pod_spec,
)

# the oldest Kubernetes release still commonly run, and the newest the schemas know
VERSIONS = ("1.30.0", kubernetes_validate.latest_version() + ".0")
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def test_the_manifests_hold_gateways_engines_and_redis() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in manifests()}
    assert {
        ("Deployment", "quillcache-gateway"),
        ("Service", "quillcache-gateway"),
        ("ConfigMap", "quillcache-gateway"),
        ("StatefulSet", "quillcache-engine"),
        ("Service", "quillcache-engine"),
        ("Deployment", "quillcache-redis"),
        ("Service", "quillcache-redis"),
    } <= kinds
    assert find("Deployment", "quillcache-gateway")["spec"]["replicas"] >= 2


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_is_valid_for_kubernetes(version: str) -> None:
    problems = []
    for path, doc in manifests():
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            problems.append(f"{path.name}: {doc['kind']}/{doc['metadata']['name']}: {exc}")
    assert not problems, "\n".join(problems)


def test_the_validator_refuses_a_misspelt_field() -> None:
    """Strict validation is live: a probe field with a typo is an error."""
    deployment = copy.deepcopy(find("Deployment", "quillcache-gateway"))
    gateway = pod_spec(deployment)["containers"][0]
    gateway["readinesProbe"] = gateway.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[0], strict=True)


def test_gateway_probes_readiness_on_ready_and_liveness_on_health() -> None:
    gateway = container(find("Deployment", "quillcache-gateway"), "gateway")
    port = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway["startupProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert gateway[probe]["httpGet"]["port"] in port
    config = yaml.safe_load(gateway_config_text())
    assert port["http"] == config["port"]


def test_services_select_their_pods_on_named_ports() -> None:
    for _, svc in manifests():
        if svc["kind"] != "Service":
            continue
        selector = svc["spec"]["selector"]
        targets = [
            d
            for _, d in manifests()
            if d["kind"] in WORKLOADS
            and selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)}"
        (workload,) = targets
        assert workload["spec"]["selector"]["matchLabels"].items() <= (
            workload["spec"]["template"]["metadata"]["labels"].items()
        )
        names = {p["name"] for c in pod_spec(workload)["containers"] for p in c.get("ports", [])}
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)


def quillcache_containers() -> list[tuple[str, dict[str, Any]]]:
    """Every container that runs the image's entrypoint (`quillcache`) with its args."""
    image = container(find("Deployment", "quillcache-gateway"), "gateway")["image"]
    out = []
    for _, d in manifests():
        if d["kind"] not in WORKLOADS:
            continue
        for c in pod_spec(d)["containers"]:
            if c["image"] == image:
                assert "command" not in c, f"{c['name']}: keep the image's entrypoint"
                out.append((f"{d['metadata']['name']}/{c['name']}", c))
    return out


def subcommand_flags(name: str) -> set[str]:
    """The exact option strings of one subcommand, from its own `add_arguments`."""
    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[name][0]).add_arguments(parser)
    return {s for action in parser._actions for s in action.option_strings}


def test_every_quillcache_container_runs_flags_todays_cli_accepts() -> None:
    """Each container's args parse with the real `quillcache` parser, and each flag is
    spelt in full (argparse would also take an abbreviation that a later flag breaks)."""
    found = quillcache_containers()
    assert {n for n, _ in found} == {"quillcache-gateway/gateway", "quillcache-engine/engine"}
    assert dockerfile_stages(DOCKERFILE.read_text())[-1].exec_form("ENTRYPOINT") == ["quillcache"]
    for name, c in found:
        args = [str(a) for a in c["args"]]
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            pytest.fail(f"{name}: `quillcache {' '.join(args)}` refused (exit {exc.code})")
        flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        unknown = flags - subcommand_flags(args[0])
        assert not unknown, f"{name}: flags `quillcache {args[0]}` does not have: {unknown}"


def test_a_flag_that_does_not_exist_is_caught() -> None:
    """The check above can fail: a flag the gateway does not have is refused."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", "--peer-snapshot", "http://quillcache-gateway"])
    assert "--peer-snapshot" not in subcommand_flags("gateway")


def test_the_gateway_config_is_valid_and_lists_every_engine(tmp_path: Path) -> None:
    deployment = find("Deployment", "quillcache-gateway")
    gateway = container(deployment, "gateway")
    config_path = gateway["args"][gateway["args"].index("--config") + 1]
    mounts = {m["name"]: m["mountPath"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(deployment)["volumes"]}
    (config_volume,) = [n for n, v in volumes.items() if "configMap" in v]
    assert volumes[config_volume]["configMap"]["name"] == "quillcache-gateway"
    assert config_path == f"{mounts[config_volume]}/gateway.yaml"

    written = tmp_path / "gateway.yaml"
    written.write_text(gateway_config_text())
    config = load_config(written)  # the gateway's own checks
    engines = find("StatefulSet", "quillcache-engine")
    service = engines["spec"]["serviceName"]
    port = container(engines, "engine")["ports"][0]["containerPort"]
    expected = [
        f"http://{engines['metadata']['name']}-{i}.{service}:{port}"
        for i in range(engines["spec"]["replicas"])
    ]
    assert [w.url for w in config.workers] == expected
    assert config.host == "0.0.0.0"

    # the secret file the config names is where the init container copies it
    assert config.secret_file is not None
    secret_dir = str(Path(config.secret_file).parent)
    assert mounts["state"] == secret_dir
    (init,) = pod_spec(deployment)["initContainers"]
    assert init["command"][-1].endswith(f" {secret_dir}/")
    init_mounts = {m["name"]: m["mountPath"] for m in init["volumeMounts"]}
    assert (
        init["command"][-1].split()[-2]
        == f"{init_mounts['secret']}/{Path(config.secret_file).name}"
    )
    assert volumes["secret"]["secret"]["secretName"] == "quillcache-gateway-secret"
