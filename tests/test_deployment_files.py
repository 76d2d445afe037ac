"""The files that deploy the service agree with each other and with the code: the Dockerfile
(no container runtime here to build it), the KubeRay manifest that names its image, and every
Serve config in ray_configs/ (paths, ports, the import path, the settings)."""
import importlib
import re
import shlex

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from app.config import AppConfig
from tests.serve_process import ROOT

DEPLOYMENTS = {"EngineServer", "OpenAIIngress"}
SERVE_CONFIGS = sorted((ROOT / "ray_configs").glob("serve_*.yaml"))


def dockerfile() -> dict[str, list[str]]:
    """The Dockerfile's instructions by keyword (continuation lines joined, comments out)."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    instructions: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            keyword, _, rest = line.strip().partition(" ")
            instructions.setdefault(keyword.upper(), []).append(rest.strip())
    return instructions


def kuberay() -> dict:
    return yaml.safe_load((ROOT / "ray_configs" / "kuberay_rayservice.yaml").read_text())


def _containers(manifest: dict) -> list[dict]:
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


def _check_serve_config(config: dict, exposed_ports: set[int]) -> None:
    schema = ServeDeploySchema.model_validate(config)
    assert schema.http_options.port in exposed_ports
    for app in config["applications"]:
        module, _, attr = app["import_path"].partition(":")
        assert callable(getattr(importlib.import_module(module), attr))
        AppConfig.model_validate(app.get("args") or {})  # every setting exists and is valid
        assert {d["name"] for d in app.get("deployments", [])} <= DEPLOYMENTS


def test_the_dockerfile_installs_the_repository_where_the_manifest_runs_it():
    docker = dockerfile()
    (workdir,) = docker["WORKDIR"]
    for copy in docker["COPY"]:
        *sources, _ = shlex.split(copy)
        assert all((ROOT / s).exists() for s in sources), copy
    assert "./scripts/setup.sh" in " ".join(docker["RUN"])
    assert f"PATH={workdir}/.venv/bin:" in " ".join(docker["ENV"])
    manifest = kuberay()
    containers = _containers(manifest)
    assert {c["image"] for c in containers} == {"mini-infer:latest"}
    head_command = " ".join(containers[0]["args"])
    assert f"{workdir}/.venv/bin/ray start --head" in head_command
    serve_config = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert all(app["runtime_env"]["working_dir"] == f"local://{workdir}" for app in serve_config["applications"])


def test_ports_agree():
    exposed = {int(p) for line in dockerfile()["EXPOSE"] for p in line.split()}
    manifest = kuberay()
    ports = {p["name"]: p["containerPort"] for p in _containers(manifest)[0]["ports"]}
    assert ports == {"gcs": 6379, "dashboard": 8265, "serve": 8000}
    assert set(ports.values()) <= exposed
    assert yaml.safe_load(manifest["spec"]["serveConfigV2"])["http_options"]["port"] == ports["serve"]


def test_the_manifests_serve_config_is_valid():
    exposed = {int(p) for line in dockerfile()["EXPOSE"] for p in line.split()}
    _check_serve_config(yaml.safe_load(kuberay()["spec"]["serveConfigV2"]), exposed)


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_serve_config_is_valid(path):
    exposed = {int(p) for line in dockerfile()["EXPOSE"] for p in line.split()}
    _check_serve_config(yaml.safe_load(path.read_text()), exposed)


def test_the_images_default_command_serves_on_every_interface():
    (cmd,) = dockerfile()["CMD"]
    program, verb, config_path = yaml.safe_load(cmd)  # a JSON array
    assert (program, verb) == ("serve", "run")
    config = yaml.safe_load((ROOT / config_path).read_text())
    assert config["http_options"]["host"] == "0.0.0.0"
