"""The job's composite reward (`scoring.rewards`): its components built from the job, the reward models in Ray
actors, and the check that each reward model loads before any actor starts.

A reward-model call past its `timeout_s`, an actor that died or a scorer that raised fails that call's samples
(reward 0, the reason in the ledger) and never the job; a timed-out or dead actor is replaced for the next call.
Only an actor that cannot start at all stops the job, as a verifier worker that cannot start does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.job import Job, JobError, JobValidationError, RewardSection
from tasks.base import Problem, Task, TaskError
from tasks.rewards import (
    CompositeScorer,
    FormatReward,
    Messages,
    RewardComponent,
    RewardModelScorer,
    WeightedComponent,
    reward_model_problem,
)
from tasks.scoring import RewardWorkerError, ScorePool, ScoreResult, checked_score

# Each component's step metric: the mean of its score over the responses scored since the previous step.
REWARD_METRICS = {
    "task": "rollout/reward_task_mean",
    "format": "rollout/reward_format_mean",
    "reward_model": "rollout/reward_reward_model_mean",
}


class RewardModelActor:
    """`RewardModelScorer` in a Ray actor, on a GPU when its section gives it one."""

    def __init__(self, path: str, max_length: int, batch_size: int, gpu: bool) -> None:
        self.scorer = RewardModelScorer(path, max_length, batch_size, "cuda" if gpu else "cpu")

    def ready(self) -> bool:
        return True

    def score(self, conversations: Sequence[tuple[Messages, str]]) -> list[ScoreResult]:
        return self.scorer.score(conversations)


class ActorRewardModel:
    """A reward-model component: each call goes to the actor under `timeout_s`. `start` makes an actor; the
    first is waited for up to `startup_timeout_s` (loading the model), and so is each replacement."""

    def __init__(
        self,
        start: Callable[[], Any],
        messages: Callable[[Problem], Messages],
        timeout_s: float,
        startup_timeout_s: float,
    ) -> None:
        self._start, self.messages = start, messages
        self.timeout_s, self.startup_timeout_s = timeout_s, startup_timeout_s
        self.actor: Any = None
        self.replaced = 0
        self._ensure_actor()

    def _ensure_actor(self) -> None:
        if self.actor is not None:
            return
        actor = self._start()
        try:
            ray.get(actor.ready.remote(), timeout=self.startup_timeout_s)
        except GetTimeoutError:
            ray.kill(actor)
            raise RewardWorkerError(
                f"the reward model actor did not start within {self.startup_timeout_s:g} s (scoring.startup_timeout_s)"
            ) from None
        except (RayActorError, RayTaskError) as error:
            raise RewardWorkerError(f"the reward model actor failed to start: {_cause(error)}") from None
        self.actor = actor

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        self._ensure_actor()
        ref = self.actor.score.remote([(self.messages(p), c) for p, c in zip(problems, completions, strict=True)])
        try:
            return list(ray.get(ref, timeout=self.timeout_s))
        except GetTimeoutError:
            reason = f"timed out after {self.timeout_s:g} s"
        except RayActorError:
            reason = "its actor died"
        except RayTaskError as error:  # only a bug outside the scorer's own batch handling
            return [ScoreResult(0.0, f"raised {_cause(error)}"[:300])] * len(completions)
        self._replace()
        return [ScoreResult(0.0, reason)] * len(completions)

    def _replace(self) -> None:
        """A hung or dead actor goes; the next call starts another (its queue would only time out behind it)."""
        ray.kill(self.actor)
        self.actor = None
        self.replaced += 1

    def close(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor = None


def _cause(error: Exception) -> str:
    """What raised inside the actor, without Ray's traceback: `Type: message`."""
    task_error = (
        error
        if isinstance(error, RayTaskError)
        else next((arg for arg in error.args if isinstance(arg, RayTaskError)), None)
    )
    cause = getattr(task_error, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"[:300]
    return str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__


def _reward_model(job: Job, task: Task, section: RewardSection, pool: ScorePool) -> RewardComponent:
    def start() -> Any:
        remote = ray.remote(RewardModelActor).options(num_cpus=1, num_gpus=section.gpus or 0)
        return remote.remote(section.path, section.max_length, section.batch_size, bool(section.gpus))

    return ActorRewardModel(start, task.messages, section.timeout_s or 60.0, job.scoring.startup_timeout_s)


# How each kind of scoring.rewards component is built: (job, task, its section, the verifier pool).
REWARD_BUILDERS: dict[str, Callable[[Job, Task, RewardSection, ScorePool], RewardComponent]] = {
    "task": lambda job, task, section, pool: pool,
    "format": lambda job, task, section, pool: FormatReward(),
    "reward_model": _reward_model,
}


def training_scorer(job: Job, task: Task, pool: ScorePool) -> ScorePool | CompositeScorer:
    """What scores the training samples: the verifier pool alone, or the composite of `scoring.rewards` (which
    closes the pool with its own components)."""
    if not job.scoring.rewards:
        return pool
    components: list[WeightedComponent] = []
    try:
        for section in job.scoring.rewards:
            components.append(
                WeightedComponent(section.name, section.weight, REWARD_BUILDERS[section.name](job, task, section, pool))
            )
    except BaseException:
        for built in components:
            if built.component is not pool:
                built.component.close()
        raise
    return CompositeScorer(components, closing=(pool,))


def reward_model_errors(job: Job) -> list[JobError]:
    """Each scoring.rewards reward model that would not load (`reward_model_problem`), by its field: read from
    its files here, before any actor starts."""
    problems = (
        (index, reward_model_problem(section.path or ""))
        for index, section in enumerate(job.scoring.rewards or [])
        if section.name == "reward_model"
    )
    return [JobError(f"scoring.rewards.{index}.path", problem) for index, problem in problems if problem]


def check_reward_models(job: Job) -> None:
    """Raise `JobValidationError` naming each reward model path that would not load (see `reward_model_errors`)."""
    errors = reward_model_errors(job)
    if errors:
        raise JobValidationError(job.name, errors)


def check_first_score(job: Job, task: Task) -> None:
    """Score the first training row once, with the completion the task's own demonstration gives (the answer in
    the format it asks for), and raise `TaskError` if the verifier raises or returns no finite number: a reward
    function broken on every row is refused before anything starts, not found in the ledger after a run. Any
    number, 0 included, passes."""
    from cluster.run.faults import reward_source

    problem = next(iter(task.problems("train", job.seed)), None)
    if problem is None:
        return
    try:
        completion = task.demonstration(problem)
    except NotImplementedError:
        completion = problem.answer
    result = checked_score(task, problem, completion)
    if result.error is not None:
        source = reward_source(job.task.name, getattr(job.task, "reward", None), composite=False)
        raise TaskError(
            f"{source} {result.error} on the training row {problem.problem_id} with the completion {completion!r:.80}; "
            "every response would fail to score: fix it, then validate again"
        )
