"""A reward that fails: counted per step, said once, and the run stopped once a step's worth failed in a row."""

from __future__ import annotations

import math

from cluster.job import validate_job
from cluster.run.faults import RewardsFailed, ScoreFailureStreak, UniformRewards, reward_source, streak_halt
from cluster.run.step_rows import ScoredSinceStep


def test_the_streak_counts_failures_in_a_row_and_gives_the_first_error_once():
    streak = ScoreFailureStreak(limit=4, source="task.reward 'mine.py:score'")
    assert streak.record([None, "returned nan, not a finite number", None]) == "returned nan, not a finite number"
    assert streak.in_a_row == 0 and not streak.exhausted  # the last response scored
    assert streak.record(["returned None (NoneType), not a number", "raised ValueError: x"]) is None  # said once
    assert streak.in_a_row == 2 and not streak.exhausted
    streak.record(["a", "b"])
    assert streak.in_a_row == 4 and streak.exhausted
    assert streak.first_error == "returned nan, not a finite number"
    assert streak.first_alert("rows-000002").startswith(
        "task.reward 'mine.py:score' failed on a response of problem rows-000002: returned nan, not a finite number."
    )


def test_a_streak_halts_the_run_with_what_to_change():
    """Uniform groups or failed scores, a step's worth in a row: which error, why, and the field to fix."""
    from types import SimpleNamespace

    job = validate_job(
        {
            "task": {"name": "dataset", "path": "rows.jsonl", "reward": "mine.py:score"},
            "learner": {"prompts_per_step": 2},
            "generator": {"samples_per_prompt": 4},
        }
    )
    failures = ScoreFailureStreak.of(job)
    assert (failures.limit, failures.source) == (8, "task.reward 'mine.py:score'")
    calm = SimpleNamespace(uniform_in_a_row=0)
    assert streak_halt(calm, failures, job) is None
    failures.record(["returned None (NoneType), not a number"] * 8)
    error, why, fix = streak_halt(calm, failures, job)
    assert error is RewardsFailed and why.startswith("8 responses in a row failed to score (task.reward")
    assert "returned None" in why and fix.endswith("named by task.reward 'mine.py:score'")
    limit = job.algorithm.max_uniform_groups_in_a_row
    error, why, fix = streak_halt(SimpleNamespace(uniform_in_a_row=limit), failures, job)
    assert error is UniformRewards and "algorithm.drop_uniform_groups: false" in fix


def test_the_reward_source_names_the_field_the_user_set():
    assert reward_source("dataset", "mine.py:score", composite=False) == "task.reward 'mine.py:score'"
    assert reward_source("dataset", "math", composite=False) == "task 'dataset''s verifier"
    assert reward_source("arithmetic", None, composite=False) == "task 'arithmetic''s verifier"
    assert reward_source("arithmetic", None, composite=True) == "scoring.rewards"


def test_a_step_row_counts_score_errors_and_leaves_out_what_had_no_data():
    """No NaN for "nothing happened": a row with nothing scored since the last leaves out the shares and
    means (it used to log rollout/truncated_share NaN); the score-error count is there whenever a response was."""
    algorithm = validate_job({"task": {"name": "arithmetic"}, "algorithm": {"overlong_buffer_tokens": 2}}).algorithm
    assert ScoredSinceStep().metrics(algorithm, tool_episodes=True) == {}
    scored = ScoredSinceStep(rewards=[1.0, 0.0, 0.0], overlong_penalties=[0.0, 0.0, -0.5], truncated=1, score_errors=2)
    row = scored.metrics(algorithm, tool_episodes=True)
    assert row["rollout/score_errors"] == 2 and row["rollout/truncated_share"] == 1 / 3
    assert row["rollout/overlong_penalty_mean"] == -0.5 / 3
    assert "rollout/turns_mean" not in row  # no tool episode among them
    assert not any(isinstance(value, float) and math.isnan(value) for value in row.values())


def test_a_scored_group_is_recorded_by_the_row_that_reports_it():
    """The loop hands each scored group to `ScoredSinceStep.record` instead of writing its fields one by one."""

    def completion(reward: float, finish: str, error: str | None) -> dict:
        return dict(
            completion_ids=[5, 6],
            behaviour_logprobs=[-1.0, -1.0],
            text="x",
            finish_reason=finish,
            version_spans=[[0, 0, 2]],
            reward=reward,
            score_error=error,
        )

    scored = ScoredSinceStep()
    group = [completion(1.0, "stop", None), completion(-0.5, "length", None), completion(0.0, "stop", "raised")]
    scored.record(group, [0.0, -0.5, 0.0], {"task": [1.0, 0.0], "format": []})
    scored.record([completion(0.5, "stop", None)], [0.0], {"task": [0.5], "format": [1.0]})
    scored.record_group_kept(False)
    scored.record_group_kept(True)
    assert scored.rewards == [1.0, -0.5, 0.0, 0.5] and scored.overlong_penalties == [0.0, -0.5, 0.0, 0.0]
    assert scored.score_errors == 1 and scored.truncated == 1 and scored.uniform_groups_dropped == 1
    assert scored.components == {"task": [1.0, 0.0, 0.5], "format": [1.0]}
