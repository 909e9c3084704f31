"""Several Ray nodes on this machine (`ray.cluster_utils.Cluster`): placement by node resources, and
elastic generators that follow nodes joining and leaving a running job.

The job runs as `stableasync train` in a subprocess joined to the cluster, as on a real head node,
while the test adds and removes generator nodes under it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from actors.buffer import audit_ledger  # noqa: E402

OBJECT_STORE_BYTES = 150 << 20
STEPS = 600  # long enough (a few minutes on 2 cores) for a node to join and another to leave mid-run


@pytest.fixture
def cluster(monkeypatch, tmp_path):
    from ray.cluster_utils import Cluster

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("STABLEASYNC_CACHE", str(tmp_path / "cache"))
    head = Cluster(
        initialize_head=True,
        connect=False,
        head_node_args={
            "num_cpus": 1,
            "resources": {"learner": 1},
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
        },
    )
    yield head
    head.shutdown()


def _add_generator_node(cluster):
    return cluster.add_node(num_cpus=1, resources={"generator": 1}, object_store_memory=OBJECT_STORE_BYTES)


def _job_file(tmp_path: Path, address: str, steps: int, **generator) -> tuple[Path, Path]:
    runs = tmp_path / "runs"
    job = {
        "name": "multinode",
        "model": {"path": "tiny", "sft_warmup": {"steps": 2, "prompts_per_step": 8}},
        "task": {"name": "arithmetic"},
        "generator": {
            "num_generators": 1,
            "samples_per_prompt": 4,
            "prompts_per_request": 2,
            "max_new_tokens": 8,
            "max_model_len": 96,
            **generator,
        },
        "learner": {"num_ranks": 1, "steps": steps, "prompts_per_step": 2, "learning_rate": 1e-3},
        "async": {"max_lag": 1},
        "cluster": {"address": address, "generator_resource": "generator", "learner_resource": "learner"},
        "logging": {"run_dir": str(runs), "run_name": "run", "wandb": {"mode": "disabled"}, "progress_bar": False},
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path, runs / "run"


def _start(job_file: Path, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "cluster.cli", "train", str(job_file)],
        stdout=open(tmp_path / "driver.log", "w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ),
    )


def _finish(driver: subprocess.Popen, tmp_path: Path, timeout_s: float = 400) -> None:
    try:
        driver.wait(timeout=timeout_s)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, (tmp_path / "driver.log").read_text()[-4000:]


def _rl_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [row for row in map(json.loads, path.read_text().splitlines()) if row["train/step"] > 0]


def _wait_for(condition, driver: subprocess.Popen, tmp_path: Path, what: str, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if driver.poll() is not None:
            raise AssertionError(f"the job ended before {what}:\n" + (tmp_path / "driver.log").read_text()[-4000:])
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n" + (tmp_path / "driver.log").read_text()[-4000:])
        time.sleep(0.5)


def test_generators_run_on_generator_nodes_and_the_learner_on_its_own(cluster, tmp_path):
    generator_node = _add_generator_node(cluster)
    job_file, run_dir = _job_file(tmp_path, cluster.address, steps=3)
    _finish(_start(job_file, tmp_path), tmp_path)
    placement = json.loads((run_dir / "summary.json").read_text())["generators"]
    assert placement["generator_nodes"] == {"0": generator_node.node_id}
    assert placement["learner_nodes"] == [cluster.head_node.node_id]
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == []
    assert sum(r["event"] == "trained" for r in rows) == 3 * 2


@pytest.mark.slow  # 82 s in CI; test_fake_autoscaler.py (also slow) has a node join a running job via the autoscaler
def test_elastic_generators_follow_nodes_joining_and_leaving(cluster, tmp_path):
    first = _add_generator_node(cluster)
    job_file, run_dir = _job_file(tmp_path, cluster.address, steps=STEPS, max_generators=3)
    driver = _start(job_file, tmp_path)

    def generators() -> int | None:
        rows = _rl_rows(run_dir)
        return rows[-1]["async/num_generators"] if rows else None

    _wait_for(lambda: generators() == 1, driver, tmp_path, "the first RL steps")
    second = _add_generator_node(cluster)
    _wait_for(lambda: generators() == 2, driver, tmp_path, "a generator to join on the new node")
    cluster.remove_node(first)
    _wait_for(lambda: generators() == 1, driver, tmp_path, "the generator of the removed node to leave")
    _finish(driver, tmp_path)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["generators"]["joined"] == 1 and summary["generators"]["left"] == 1
    assert summary["generators"]["generator_nodes"] == {"0": first.node_id, "1": second.node_id}
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == [], "every prompt group trained or dropped exactly once"
    trained = [r for r in rows if r["event"] == "trained"]
    assert len(trained) == STEPS * 2
    assert {r["generator_index"] for r in trained} == {0, 1}, "both generators' groups were trained"
    reissued = [r for r in rows if r["event"] == "reissued"]
    assert all(r["generator_index"] == 1 and "generator 0 left" in r["reason"] for r in reissued)


def test_every_node_is_asked_which_paths_it_sees(cluster, tmp_path):
    """The start-up check of a multi-node job runs on every node: each reports the driver's paths it
    cannot see (here nodes share this machine's disk, so only the path that exists nowhere). Run from a
    driver process of its own, as a job's driver is (Ray keeps a process's first connection settings)."""
    other = _add_generator_node(cluster)
    seen, nowhere = tmp_path / "runs", tmp_path / "absent"
    seen.mkdir()
    code = (
        "import json, ray; from cluster.run import ray_cluster; "
        f"ray.init(address={cluster.address!r}, logging_level='ERROR'); "
        f"missing = ray_cluster.paths_missing_on_nodes([{str(seen)!r}, {str(nowhere)!r}]); "
        "nodes = sorted(n['NodeID'] for n in ray.nodes() if n['Alive']); "
        "print(json.dumps({'missing': missing, 'nodes': nodes}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert other.node_id in report["nodes"] and len(report["nodes"]) == 2
    assert report["missing"] == {node: [str(nowhere)] for node in report["nodes"]}
