"""The reward model in a Ray actor: scores as in-process, and a call that times out or whose actor dies fails
that call's samples with the reason, replacing the actor; an actor that cannot start stops the job."""

from __future__ import annotations

import time

import pytest
import ray

from cluster.run.rewards import ActorRewardModel, RewardModelActor
from tasks.base import Problem
from tasks.scoring import RewardWorkerError
from tasks.testing import MisbehavingRewardModel

PROBLEM = Problem("p", "What is 1 + 1?", "2")


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="test-reward-model-actor")
    yield
    ray.shutdown()


def _messages(problem):
    return [{"role": "user", "content": problem.question}]


def _misbehaving(fail_start: bool = False):
    return lambda: ray.remote(MisbehavingRewardModel).options(num_cpus=1).remote(fail_start)


def test_a_hung_or_dead_reward_model_fails_only_that_calls_samples_and_is_replaced(local_ray):
    component = ActorRewardModel(_misbehaving(), _messages, timeout_s=2.0, startup_timeout_s=60.0)
    try:
        assert [r.reward for r in component.score_many([PROBLEM] * 2, ["ab", "abc"])] == [2.0, 3.0]
        start = time.monotonic()
        hung = component.score_many([PROBLEM] * 2, ["HANG", "ok"])
        assert time.monotonic() - start < 10
        assert [(r.reward, r.error) for r in hung] == [(0.0, "timed out after 2 s")] * 2
        assert [r.reward for r in component.score_many([PROBLEM], ["abcd"])] == [4.0]  # a fresh actor scores
        died = component.score_many([PROBLEM], ["DIE"])
        assert [(r.reward, r.error) for r in died] == [(0.0, "its actor died")]
        assert [r.error for r in component.score_many([PROBLEM], ["a"])] == [None]
        assert component.replaced == 2
    finally:
        component.close()


def test_a_reward_model_actor_that_cannot_start_stops_the_job_with_the_reason(local_ray):
    with pytest.raises(RewardWorkerError, match=r"failed to start.*CUDA out of memory while loading"):
        ActorRewardModel(_misbehaving(fail_start=True), _messages, timeout_s=2.0, startup_timeout_s=60.0)


def test_the_actor_scores_as_the_scorer_does_in_process(local_ray, tiny_qwen2, tmp_path):
    from tasks.rewards import RewardModelScorer
    from tests.unit.cluster.test_composite_rewards import COMPLETIONS, build_tiny_reward_model

    path = build_tiny_reward_model(tiny_qwen2, tmp_path / "rm")
    inline = RewardModelScorer(path, max_length=64, batch_size=3).score([(_messages(PROBLEM), c) for c in COMPLETIONS])
    start = lambda: ray.remote(RewardModelActor).options(num_cpus=1).remote(path, 64, 3, False)  # noqa: E731
    component = ActorRewardModel(start, _messages, timeout_s=60.0, startup_timeout_s=120.0)
    try:
        remote = component.score_many([PROBLEM] * len(COMPLETIONS), COMPLETIONS)
    finally:
        component.close()
    assert [r.error for r in remote] == [None] * len(COMPLETIONS)
    assert [r.reward for r in remote] == pytest.approx([r.reward for r in inline], abs=1e-5)
