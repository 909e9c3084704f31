"""The RL learning-rate schedule: warm-up ramp, constant, linear and cosine decay to the floor."""

from __future__ import annotations

import math

import pytest

from cluster.job import validate_job
from learner.lr_schedule import lr_factor


def test_warm_up_ramps_linearly_then_constant_stays_at_one():
    assert [lr_factor(step, 10, warmup_steps=4) for step in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor(step, 10) for step in (0, 5, 9)] == [1.0, 1.0, 1.0]  # the default: no schedule at all


def test_decays_end_at_the_floor_on_the_last_step():
    linear = [lr_factor(step, 5, schedule="linear", min_ratio=0.2) for step in range(5)]
    assert linear == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    cosine = [lr_factor(step, 5, schedule="cosine") for step in range(5)]
    assert cosine == pytest.approx(
        [1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0]
    )
    after_warm_up = [lr_factor(step, 6, warmup_steps=2, schedule="linear") for step in range(6)]
    assert after_warm_up == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])
    assert lr_factor(7, 5, schedule="linear", min_ratio=0.1) == pytest.approx(0.1)  # past the end: the floor


def test_edge_cases():
    assert lr_factor(0, 1, schedule="cosine", min_ratio=0.3) == pytest.approx(0.3)  # a one-step run decays at once
    assert [lr_factor(s, 3, warmup_steps=3, schedule="cosine") for s in range(3)] == pytest.approx([1 / 3, 2 / 3, 1])
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'step'"):
        lr_factor(0, 5, schedule="step")  # type: ignore[arg-type]


def test_the_job_checks_the_schedule_fields():
    task = {"name": "arithmetic"}
    job = validate_job(
        {"task": task, "learner": {"steps": 10, "lr_warmup_steps": 3, "lr_schedule": "cosine", "lr_min_ratio": 0.1}}
    )
    assert (job.learner.lr_warmup_steps, job.learner.lr_schedule, job.learner.lr_min_ratio) == (3, "cosine", 0.1)
    from cluster.job import JobValidationError

    with pytest.raises(JobValidationError) as error:
        validate_job(
            {"task": task, "learner": {"steps": 10, "lr_warmup_steps": 11, "lr_schedule": "step", "lr_min_ratio": 2}}
        )
    text = str(error.value)
    for field in ("learner.lr_schedule", "learner.lr_min_ratio"):
        assert field in text, text
    with pytest.raises(JobValidationError, match=r"learner.lr_warmup_steps.*11 warm-up steps is more than the 10"):
        validate_job({"task": task, "learner": {"steps": 10, "lr_warmup_steps": 11}})
