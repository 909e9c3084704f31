"""A whole job with a composite reward on a local Ray cluster: the task's verifier, a reward model in its own
actor and the format term, each component in the step rows, every sample scored without a failure."""

from __future__ import annotations

import json
import math

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from cluster.job import validate_job  # noqa: E402
from tests.integration.test_pipeline import _job  # noqa: E402
from tests.unit.test_composite_rewards import build_tiny_reward_model  # noqa: E402


@pytest.fixture(scope="module")
def local_ray(tmp_path_factory):
    import os

    from cluster.run.runtime import actor_env

    os.environ["STABLEASYNC_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    ray.init(address="local", num_cpus=3, include_dashboard=False, namespace="stableasync-tests-rewards",
             _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
             runtime_env={"env_vars": actor_env()})
    yield
    ray.shutdown()


@pytest.mark.slow  # 85 s: a whole job; tests/component/test_reward_model_actor.py runs the actor in the default suite
def test_a_job_with_a_reward_model_logs_each_component(local_ray, tiny_qwen2, tmp_path):
    from cluster.run.driver import train

    reward_model = build_tiny_reward_model(tiny_qwen2, tmp_path / "rm")
    job = _job(tmp_path, max_lag=1, steps=2, learner={"num_ranks": 1, "prompts_per_step": 2},
               model={"sft_warmup": {"steps": 0}},
               scoring={"timeout_s": 60, "rewards": [  # generous: a shared CI machine may be slow, not failing
                   {"name": "task", "weight": 1.0},
                   {"name": "reward_model", "weight": 0.5, "path": reward_model, "max_length": 64, "timeout_s": 300},
                   {"name": "format", "weight": 0.1}]})
    result = train(validate_job(job))
    rows = [json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if row["train/step"] > 0]
    assert [row["train/step"] for row in steps] == [1, 2]
    for key in ("rollout/reward_task_mean", "rollout/reward_reward_model_mean", "rollout/reward_format_mean"):
        assert all(key in row for row in steps) and any(math.isfinite(row[key]) for row in steps), key
    ledger = [json.loads(line) for line in (result.run_dir / "ledger.jsonl").read_text().splitlines()]
    scored = [row for row in ledger if row["event"] == "scored"]
    assert scored and all(row["score_errors"] == 0 for row in scored)
    samples = [json.loads(line) for line in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    rule_only = {round(task + 0.1 * form, 6) for task in (0.0, 0.1, 1.0) for form in (0, 1)}
    assert samples and any(round(s["reward"], 6) not in rule_only for s in samples), "the reward model adds its part"
