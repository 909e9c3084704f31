"""deploy/clusters/local.yaml under Ray's real autoscaler (fake_multinode provider): it brings up the
YAML's generator node, and when more generator capacity is requested while an elastic job runs, the
autoscaler adds a node and the job starts a generator on it.

Slow (the autoscaler starts nodes at its own pace) and it needs Ray's default port 6379 free, where the
fake provider's nodes look for their head: `pytest -m slow tests/integration/test_fake_autoscaler.py`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")

import contextlib

from actors.buffer import audit_ledger

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.slow


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


def _python(code: str, env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True, timeout=120
    ).stdout


RESOURCES = (
    "import ray; ray.init(address='127.0.0.1:6379', logging_level='ERROR'); "
    "print('generator_units', ray.cluster_resources().get('generator', 0))"
)
REQUEST = (
    "import ray; from ray.autoscaler.sdk import request_resources; ray.init(address='127.0.0.1:6379', "
    "logging_level='ERROR'); request_resources(bundles=[{'generator': 1}] * 2)"
)


@pytest.fixture
def fake_cluster(tmp_path):
    if not _port_free(6379):
        pytest.skip("port 6379 is taken; the fake provider's nodes join a head there")
    env = {
        **os.environ,
        "RAY_FAKE_CLUSTER": "1",
        "RAY_AUTH_MODE": "disabled",
        "STABLEASYNC_CACHE": str(tmp_path / "cache"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            "--port=6379",
            "--node-ip-address=127.0.0.1",
            f"--autoscaling-config={ROOT / 'deploy' / 'clusters' / 'local.yaml'}",
            "--num-cpus=2",
            "--resources",
            json.dumps({"learner": 1}),
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=open(tmp_path / "head.log", "w"),  # noqa: SIM115 - the process writes it until killed
        stderr=subprocess.STDOUT,
    )
    try:
        yield env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            head.wait(timeout=60)
        subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def _generator_units(env: dict[str, str]) -> float:
    """The cluster's `generator` units; Ray may print its own lines (a head still starting) around ours."""
    lines = [line.split() for line in _python(RESOURCES, env).splitlines()]
    return max((float(words[1]) for words in lines if len(words) == 2 and words[0] == "generator_units"), default=0.0)


def _wait(condition, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(2)


def test_the_autoscaler_adds_a_generator_node_and_the_running_job_uses_it(fake_cluster, tmp_path):
    env = fake_cluster
    _wait(lambda: _generator_units(env) >= 1, "the YAML's first generator node")
    job = yaml.safe_load((ROOT / "deploy" / "jobs" / "local-cluster.yaml").read_text())
    job["model"]["sft_warmup"]["steps"] = 5
    job["learner"]["steps"] = 400
    job["cluster"]["address"] = "127.0.0.1:6379"
    job["logging"] = {
        "run_dir": str(tmp_path / "runs"),
        "run_name": "run",
        "wandb": {"mode": "disabled"},
        "progress_bar": False,
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    driver = subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", str(tmp_path / "job.yaml")],
        cwd=ROOT,
        env=env,
        stdout=open(tmp_path / "driver.log", "w"),  # noqa: SIM115 - the process writes it until killed
        stderr=subprocess.STDOUT,
    )
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"

    def generators() -> int:
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        rows = [r for r in rows if r["train/step"] > 0]
        assert driver.poll() is None or rows, (tmp_path / "driver.log").read_text()[-3000:]
        return rows[-1]["async/num_generators"] if rows else 0

    try:
        _wait(lambda: generators() == 1, "the job's first steps")
        _python(REQUEST, env)
        _wait(lambda: generators() == 2, "a generator on the node the autoscaler added")
        driver.wait(timeout=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "run" / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == []
    assert json.loads((tmp_path / "runs" / "run" / "summary.json").read_text())["generators"]["joined"] == 1
