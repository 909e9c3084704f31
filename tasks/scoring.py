"""Reward workers: verifiers (a task's, a user's reward function) run sandboxed, with a timeout and limits.

A verifier that raises, hangs, exhausts memory or CPU time, dies, floods its output or returns anything but a
finite number within `REWARD_LIMIT` marks that sample failed (reward 0.0 and the reason; the driver leaves it
out of training) and never stops the caller. Only a worker that cannot start (its task cannot be built, or is
not built within the startup timeout) raises: every sample would fail alike. The subprocess machinery
(isolation, limits, handshake, per-item deadline, replacement) is `tasks.sandbox`'s.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tasks.base import Problem, Task, TaskError, build_task
from tasks.sandbox import (
    Handler,
    SandboxLimits,
    WorkerPool,
    WorkerStartError,
    children_ignore_sigint,  # noqa: F401 - re-exported: callers start processes with it
)

# A reward's largest magnitude. One far beyond any sane scale (1e30 from a unit slip or an overflow) would set
# every advantage of its group and swamp the step's gradient, so it is a scoring failure like NaN.
REWARD_LIMIT = 1e6


@dataclass(frozen=True)
class ScoreResult:
    reward: float
    error: str | None = None
    # composite rewards (`tasks.rewards.CompositeScorer`): each component's score by its kind, the failed ones left out
    components: dict[str, float] = field(default_factory=dict)


def checked_score(task: Task, problem: Problem, completion: str) -> ScoreResult:
    """Score one completion, turning every verifier failure into a failed result."""
    try:
        reward = task.score(problem, completion)
    except MemoryError:
        return ScoreResult(0.0, "verifier ran out of memory")
    except Exception as error:
        return ScoreResult(0.0, f"raised {type(error).__name__}: {error}"[:300])
    return checked_value(reward)


def checked_batch(task: Task, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
    """Score a batch in one call of a batched reward function (`Dataset.score_batch`): a call that fails fails
    every completion of the batch with its reason; each value is checked as one reward is."""
    try:
        rewards = task.score_batch(problems, completions)
    except MemoryError:
        return [ScoreResult(0.0, "verifier ran out of memory")] * len(completions)
    except Exception as error:
        reason = str(error) if isinstance(error, TaskError) else f"raised {type(error).__name__}: {error}"
        return [ScoreResult(0.0, reason[:300])] * len(completions)
    return [checked_value(reward) for reward in rewards]


def checked_value(reward: Any) -> ScoreResult:
    """A verifier's value as a result: a finite number within REWARD_LIMIT, else a failure naming the value."""
    if isinstance(reward, bool) or not isinstance(reward, (int, float)):
        return ScoreResult(0.0, f"returned {reward!r:.80} ({type(reward).__name__}), not a number")
    if not math.isfinite(reward):
        return ScoreResult(0.0, f"returned {reward}, not a finite number")
    if abs(reward) > REWARD_LIMIT:
        return ScoreResult(0.0, f"returned {reward:g}, beyond the {REWARD_LIMIT:g} any reward stays within")
    return ScoreResult(float(reward))


def score_inline(task: Task, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
    """In-process scoring with the same failure handling (no timeout): for tests and trusted tasks."""
    return [checked_score(task, p, c) for p, c in zip(problems, completions, strict=True)]


class RewardWorkerError(WorkerStartError):
    """A reward worker could not start: every completion would fail alike, so scoring stops here."""


def _build_scorer(task_name: str, task_config: Any, extra_modules: tuple[str, ...]) -> Handler:
    """A worker's handler: (problem, completion) -> its `ScoreResult`, the task built once per worker."""
    for module in extra_modules:
        importlib.import_module(module)
    task = build_task(task_name, task_config)
    if task.batched_reward:  # an item is a chunk: (problems, completions)
        return lambda item: checked_batch(task, *item)
    return lambda item: checked_score(task, *item)


class ScorePool(WorkerPool[Any]):
    """`max_workers` verifier subprocesses, each scoring one completion at a time under `timeout_s` apiece; for a
    batched reward function (`task_config.reward_batched`), a chunk of the completions in one call under `timeout_s`.

    A worker's clock starts once it has built its task: starting (imports included) may take up to
    `startup_timeout_s`, and a worker that cannot start raises `RewardWorkerError` naming the task.
    `memory_limit_mb` is the address space a worker may add to what it holds once started; `limits` are the
    rest of the sandbox's (`tasks.sandbox.SandboxLimits`: isolation, environment, CPU, processes, files, output).
    """

    start_error = RewardWorkerError

    def __init__(
        self,
        task_name: str,
        task_config: Any,
        max_workers: int = 1,
        timeout_s: float = 5.0,
        memory_limit_mb: int | None = None,
        extra_modules: tuple[str, ...] = (),
        startup_timeout_s: float = 120.0,
        limits: SandboxLimits | None = None,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        super().__init__(
            _build_scorer,
            (task_name, task_config, tuple(extra_modules)),
            max_workers,
            timeout_s,
            memory_limit_mb,
            startup_timeout_s,
            describe=f"reward worker for task {task_name!r}",
            startup_setting="ScorePool startup_timeout_s",
            limits=limits,
        )
        self.failures = 0
        # as the workers' task decides (`Task.batched_reward`): a batched reward, one chunk per worker
        self.batched, self.chunks = bool(getattr(task_config, "reward_batched", False)), max_workers

    def score_many(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        """Score in order, each completion under the timeout (`WorkerPool.run_items`); a verifier that
        hangs or kills its worker fails that completion alone."""
        if len(problems) != len(completions):
            raise ValueError(f"{len(problems)} problems but {len(completions)} completions")
        if self.batched:
            results = self._score_chunks(problems, completions)
        else:
            results = self.run_items(list(zip(problems, completions)), lambda index, reason: ScoreResult(0.0, reason))
        self.failures += sum(r.error is not None for r in results)
        return results

    def _score_chunks(self, problems: Sequence[Problem], completions: Sequence[str]) -> list[ScoreResult]:
        """A batched reward's scores: the completions in one chunk per worker, each chunk one call; a chunk
        whose call hangs or kills its worker fails each of its completions."""
        size = -(-len(completions) // self.chunks) or 1
        starts = range(0, len(completions), size)
        chunks = [(list(problems[i : i + size]), list(completions[i : i + size])) for i in starts]
        scored = self.run_items(chunks, lambda index, reason: [ScoreResult(0.0, reason)] * len(chunks[index][1]))
        return [result for chunk in scored for result in chunk]
