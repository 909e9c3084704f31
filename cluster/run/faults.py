"""What stops a run, or restarts its learner: crashed or out-of-memory ranks, too many skipped steps, uniform
rewards. Each is an error naming what to change; a halted run leaves a checkpoint to resume from."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ray.exceptions import OutOfMemoryError, RayActorError, RayTaskError

from algorithms.errors import StableAsyncError
from cluster.run import runtime


class CannotResume(StableAsyncError, RuntimeError):
    """A learner crash the job does not come back from: restarts used up, or no checkpoint to resume."""


class LearnerCrashed(StableAsyncError, RuntimeError):
    """A learner rank died: the job can go on from its latest checkpoint in `run_dir`."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


# A learner rank died, or one failed while the others waited in a collective: the group cannot go on.
LEARNER_GROUP_FAILURES = (RayActorError, runtime.LearnerGroupBroken)


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


@dataclass
class SkipStreak:
    """Consecutive skipped steps; `record` says when the limit is reached (a finite step resets it)."""

    limit: int
    count: int = 0

    def record(self, skipped: bool) -> bool:
        self.count = self.count + 1 if skipped else 0
        return self.count >= self.limit
