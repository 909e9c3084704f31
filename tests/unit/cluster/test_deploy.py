"""The deploy YAMLs: valid for Ray's own cluster-config schema, token auth on, placement by resources."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from cluster.job import load_job

ROOT = Path(__file__).resolve().parents[3]
CLOUDS = ("aws", "gcp")
CLUSTERS = (*CLOUDS, "local")


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / "clusters" / f"{name}.yaml").read_text())


def _validate(config: dict) -> None:
    """What `ray up` does before it touches a cloud: fill in the provider's defaults, then check the schema.
    The fake_multinode provider's defaults file is not in the wheel; that YAML is complete without them."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = copy.deepcopy(config)
    validate_config(config if config["provider"]["type"] == "fake_multinode" else prepare_config(config))


@pytest.mark.parametrize("name", CLUSTERS)
def test_cluster_yaml_is_valid_for_rays_schema(name):
    _validate(_load(name))


@pytest.mark.parametrize("name", CLUSTERS)
def test_a_misspelt_field_fails_rays_schema(name):
    """The check above can fail: an unknown key in a node type is rejected."""
    import jsonschema

    config = _load(name)
    node_type = next(iter(config["available_node_types"].values()))
    node_type["min_worker"] = 1
    with pytest.raises(jsonschema.ValidationError):
        _validate(config)


@pytest.mark.parametrize("name", CLUSTERS)
def test_generator_and_learner_node_types_offer_their_resources(name):
    types = _load(name)["available_node_types"]
    offered = {resource for node in types.values() for resource in node["resources"]}
    assert {"generator", "learner"} <= offered
    generator_types = [t for t in types.values() if "generator" in t["resources"]]
    assert all(t.get("max_workers", 0) >= 1 for t in generator_types), "generators can be scaled"


@pytest.mark.parametrize("name", CLOUDS)
def test_cloud_clusters_use_token_auth_and_a_private_dashboard(name):
    config = _load(name)
    head, workers = " ".join(config["head_start_ray_commands"]), " ".join(config["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in head and "RAY_AUTH_MODE=token" in workers
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
    assert "~/.ray/auth_token" in config["file_mounts"], "every node gets the token"
    assert any("install.sh gpu" in command for command in config["setup_commands"]), "the GPU extra is installed"


@pytest.mark.parametrize("job", ["cluster.yaml", "local-cluster.yaml"])
def test_cluster_jobs_place_by_the_yaml_resources(job):
    loaded = load_job(ROOT / "deploy" / "jobs" / job)
    assert loaded.cluster.generator_resource == "generator" and loaded.cluster.learner_resource == "learner"
    assert loaded.generator.max_generators is not None, "elastic: generators follow the generator nodes"


def _gpu_pins() -> dict[str, str]:
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    return {line.split("==")[0].split("[")[0]: line.split("==")[1] for line in extra if "==" in line}


@pytest.mark.parametrize("name", CLOUDS)
def test_cloud_nodes_run_the_image_of_the_gpu_extras_vllm(name):
    image = _load(name)["docker"]["image"]
    assert image == f"vllm/vllm-openai:v{_gpu_pins()['vllm']}"
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    assert f"FROM {image}" in dockerfile and "./install.sh gpu" in dockerfile


@pytest.mark.slow  # 55 s in CI, asking the package index: run with -m slow when the pins change
def test_the_gpu_extra_resolves_on_its_own():
    """pip resolves the gpu extra from the package index (metadata only; nothing is installed) to exactly
    its pins: they work together without the cpu extra beside them. A local build tag counts as its
    version (where the index serves torch's CPU build, 2.13.0+cpu is torch 2.13.0)."""
    import json
    import subprocess
    import sys

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--quiet",
            "--report",
            "-",
            f"{ROOT}[gpu]",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resolved = {
        item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(result.stdout)["install"]
    }
    for name, version in _gpu_pins().items():
        assert resolved[name].split("+")[0] == version, (name, resolved[name])


@pytest.mark.parametrize("name", CLOUDS)
def test_cloud_nodes_share_storage_for_runs_and_prepared_models(name):
    config = _load(name)
    assert any("/mnt/shared" in command and "mount" in command for command in config["initialization_commands"])
    assert "-v /mnt/shared:/mnt/shared" in config["docker"]["run_options"], "the container sees the host's mount"
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert all("STABLEASYNC_CACHE=/mnt/shared/cache" in command for command in config[commands]), commands


@pytest.mark.parametrize("job", ["cluster.yaml", "qwen2.5-7b.yaml"])
def test_multi_node_jobs_keep_their_runs_on_the_shared_storage(job):
    assert load_job(ROOT / "deploy" / "jobs" / job).logging.run_dir.startswith("/mnt/shared/")
