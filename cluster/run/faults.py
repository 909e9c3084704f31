"""What stops a run, or restarts its learner: crashed or out-of-memory ranks, too many skipped steps, uniform
rewards, a reward that fails on every response. Each is an error naming what to change; a halted run leaves a
checkpoint to resume from."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

from actors.buffer import RolloutBuffer
from algorithms.errors import StableAsyncError
from cluster.job import Job
from cluster.run import learner_group
from tasks.dataset import BUILT_IN_REWARDS


class CannotResume(StableAsyncError, RuntimeError):
    """A learner crash the job does not come back from: restarts used up, or no checkpoint to resume."""


class LearnerCrashed(StableAsyncError, RuntimeError):
    """A learner rank died: the job can go on from its latest checkpoint in `run_dir`."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


# A learner rank died, or one failed while the others waited in a collective: the group cannot go on.
LEARNER_GROUP_FAILURES = (RayActorError, learner_group.LearnerGroupBroken)


class LearnerOutOfMemory(StableAsyncError, RuntimeError):
    """A learner rank ran out of memory: resuming with the same settings would only run out again."""


def _out_of_memory(error: BaseException) -> bool:
    """Ray's memory monitor killed the actor, or the step raised torch's (CUDA) out-of-memory error."""
    return isinstance(error, OutOfMemoryError) or any(
        cls.__name__ == "OutOfMemoryError" for cls in type(getattr(error, "cause", None) or error).__mro__
    )


@contextmanager
def learners_may_crash(doing: str, run_dir: Path) -> Iterator[None]:
    """A learner rank that dies, or a group whose collectives fell out of step, `doing` something: a
    `LearnerCrashed`, so the job goes on from its latest checkpoint (a half-written .tmp is ignored).
    One that ran out of memory stops the job with the settings to lower; its checkpoints and ledger stay."""
    try:
        yield
    except (*LEARNER_GROUP_FAILURES, OutOfMemoryError, RayTaskError) as error:
        out_of_memory = _out_of_memory(error)
        if not out_of_memory and not isinstance(error, LEARNER_GROUP_FAILURES):
            raise  # the step's own error (a bad batch, a storage failure): its message says what went wrong
        if out_of_memory:
            raise LearnerOutOfMemory(
                f"a learner rank ran out of memory {doing}: lower learner.max_tokens_per_micro_batch (the tokens "
                "one forward holds) or set learner.gradient_checkpointing: true in "
                f"{run_dir / 'job.yaml'}, then `stableasync train --resume {run_dir}` goes on from its latest "
                f"checkpoint; {type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            ) from error
        raise LearnerCrashed(
            f"a learner rank died or broke the group {doing} ({type(error).__name__}: {error})", run_dir
        ) from error


class RunHalted(StableAsyncError, RuntimeError):
    """The run stopped itself, with a checkpoint to resume from, for a reason the user must fix first."""


class NumericalFailure(RunHalted):
    """Too many steps in a row were skipped for non-finite values: stop, with a checkpoint to resume from."""


class UniformRewards(RunHalted):
    """With algorithm.drop_uniform_groups, too many groups in a row scored the same for every response: the
    generators would sample on forever without a learning signal."""


class RewardsFailed(RunHalted):
    """Every response of a step's worth in a row failed to score: nothing can train, and the reward function
    (or verifier) is broken rather than the policy."""


@dataclass
class ScoreFailureStreak:
    """Responses whose verifier failed, counted in a row across groups (a scored response resets it), and the
    first failure's reason, to be said once. `limit` is a step's worth of responses; `source` names what scores
    them, as the job file does (`reward_source`)."""

    limit: int
    source: str
    in_a_row: int = 0
    first_error: str | None = None

    @classmethod
    def of(cls, job: Job) -> ScoreFailureStreak:
        task_reward = getattr(job.task, "reward", None)
        return cls(
            job.learner.prompts_per_step * job.generator.samples_per_prompt,
            reward_source(job.task.name, task_reward, bool(job.scoring.rewards)),
        )

    def record(self, errors: list[str | None]) -> str | None:
        """A group's responses' errors, in order; returns the run's first error the first time there is one."""
        for error in errors:
            self.in_a_row = self.in_a_row + 1 if error is not None else 0
        new = next((error for error in errors if error is not None), None)
        if self.first_error is None and new is not None:
            self.first_error = new
            return new
        return None

    def first_alert(self, problem_id: str) -> str:
        return (
            f"{self.source} failed on a response of problem {problem_id}: {self.first_error}. Such responses are "
            "left out of training; rollout/score_errors counts them each step, and the ledger has each one's reason"
        )

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit


def reward_source(task_name: str, task_reward: str | None, composite: bool) -> str:
    """What scores a job's responses, as the job file names it (for messages about its failures)."""
    if composite:
        return "scoring.rewards"
    if task_reward is not None and task_reward not in BUILT_IN_REWARDS:
        return f"task.reward {task_reward!r}"
    return f"task {task_name!r}'s verifier"


def streak_halt(
    buffer: RolloutBuffer, failures: ScoreFailureStreak, job: Job
) -> tuple[type[RunHalted], str, str] | None:
    """Why no step can fill, and what to change in the job, once a streak says so: too many groups in a row
    dropped for uniform rewards, or a step's worth of responses in a row that failed to score; else None."""
    limit = job.algorithm.max_uniform_groups_in_a_row
    if buffer.uniform_in_a_row >= limit:
        why = (
            f"{buffer.uniform_in_a_row} prompt groups in a row were dropped because every response scored the "
            f"same (algorithm.max_uniform_groups_in_a_row = {limit}): the policy solves every problem it draws "
            "always or never (a task too easy or too hard for it, or a policy that stopped exploring: see "
            "stability/entropy), so no step can fill"
        )
        fix = "Change the problems or generator.temperature, or set algorithm.drop_uniform_groups: false"
        return UniformRewards, why, fix
    if failures.exhausted:
        why = (
            f"{failures.in_a_row} responses in a row failed to score ({failures.source}; the first of the run: "
            f"{failures.first_error}), a step's worth (learner.prompts_per_step x generator.samples_per_prompt), "
            "so nothing can train"
        )
        fix = "Fix the reward (it must return a finite number; ledger.jsonl has each response's reason)"
        if failures.source.startswith("task.reward"):
            fix += f", named by {failures.source}"
        return RewardsFailed, why, fix
    return None


@dataclass
class SkipStreak:
    """Consecutive skipped steps; `record` says when the limit is reached (a finite step resets it)."""

    limit: int
    count: int = 0

    def record(self, skipped: bool) -> bool:
        self.count = self.count + 1 if skipped else 0
        return self.count >= self.limit
