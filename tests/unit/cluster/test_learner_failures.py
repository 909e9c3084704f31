"""How the driver reads a learner rank's failure: out of memory stops with the knob to turn, a crash resumes."""

from __future__ import annotations

from pathlib import Path

import pytest
from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

from cluster.run.faults import LearnerCrashed, LearnerOutOfMemory, learners_may_crash


def test_a_rank_killed_by_the_memory_monitor_names_the_budget_to_lower(tmp_path: Path):
    with pytest.raises(LearnerOutOfMemory) as info, learners_may_crash("during step 1", tmp_path):
        raise OutOfMemoryError("Task was killed due to the node running low on memory.\nMemory on the node ...")
    message = str(info.value)
    assert "learner.max_tokens_per_micro_batch" in message and "learner.gradient_checkpointing" in message
    assert f"--resume {tmp_path}" in message and "running low on memory" in message
    assert not isinstance(info.value, LearnerCrashed)  # resuming unchanged would run out again


def test_torch_running_out_of_memory_inside_the_step_names_it_too(tmp_path: Path):
    import torch

    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")
    except torch.OutOfMemoryError as cause:
        wrapped = RayTaskError("train_step", "traceback", cause).as_instanceof_cause()
    with (
        pytest.raises(LearnerOutOfMemory, match="max_tokens_per_micro_batch"),
        learners_may_crash("during step 3", tmp_path),
    ):
        raise wrapped


def test_a_rank_that_died_otherwise_resumes_from_its_checkpoint(tmp_path: Path):
    with pytest.raises(LearnerCrashed) as info, learners_may_crash("during step 2", tmp_path):
        raise RayActorError()
    assert info.value.run_dir == tmp_path and "max_tokens_per_micro_batch" not in str(info.value)


def test_any_other_error_of_the_step_comes_through_as_it_is(tmp_path: Path):
    try:
        raise OSError("No space left on device")
    except OSError as cause:
        wrapped = RayTaskError("save_checkpoint", "traceback", cause).as_instanceof_cause()
    with pytest.raises(OSError) as info, learners_may_crash("while checkpointing step 4", tmp_path):
        raise wrapped
    assert info.value is wrapped and not isinstance(info.value, (LearnerCrashed, LearnerOutOfMemory))
