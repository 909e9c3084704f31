"""What the workers take from a validated job: its task, tool episodes, sandbox limits and evaluation sets.
The task, tool and sandbox modules load when these are called, not to validate a job."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from cluster.job.schema import Job
from cluster.job.schema_errors import JobError, JobValidationError
from cluster.job.sections import section_config
from cluster.job.task_sections import DEFAULT_EVAL_SET, EVAL_SET_TASK_RESETS
from cluster.job.validation import config_fields, eval_set_task
from tasks.config import TASK_CONFIGS

if TYPE_CHECKING:
    from tasks.base import Problem, Task
    from tasks.environment import EnvironmentSpec
    from tasks.sandbox import SandboxLimits


def job_task(job: Job, **overrides: Any) -> Task:
    """The job's task, built from its section; `overrides` replace fields of its config (the evaluation
    set's data file)."""
    from tasks.base import build_task  # the task modules load when a task is built, not to validate a job

    return build_task(job.task.name, dataclasses.replace(section_config(job.task, TASK_CONFIGS), **overrides))


def environment_spec(job: Job) -> EnvironmentSpec | None:
    """The job's tool episodes as generators and the warm-up take them; None: one turn per response."""
    from tasks.environment import EnvironmentSpec  # standard library only, like the task configs

    e = job.environment
    if not e.tools:
        return None
    return EnvironmentSpec(
        tuple(e.tools),
        e.max_turns,
        e.tool_call_format,
        e.tool_timeout_s,
        e.tool_memory_limit_mb,
        e.max_tool_output_chars,
        e.tool_workers,
        sandbox_limits(job),
    )


def sandbox_limits(job: Job) -> SandboxLimits:
    """The job's `sandbox` section as the worker pools take it."""
    from tasks.sandbox import SandboxLimits  # standard library only

    s = job.sandbox
    return SandboxLimits(
        s.isolation, tuple(s.env), s.cpu_s, s.max_processes, s.max_file_mb, s.max_open_files, s.max_output_chars
    )


def check_sandbox(job: Job, source: str = "job") -> None:
    """JobValidationError naming `sandbox.isolation` when it asks for namespaces this machine cannot start (the
    job's file alone cannot say: `validate` and `train` ask here, before anything starts)."""
    from tasks.sandbox import namespaces_unavailable

    if job.sandbox.isolation == "namespaces" and (why := namespaces_unavailable()) is not None:
        raise JobValidationError(
            source,
            [
                JobError(
                    "sandbox.isolation",
                    f"namespaces cannot start on this machine: {why}; use auto or none (docs/security.md)",
                )
            ],
        )


def evaluation_set(job: Job, task: Task, always: bool = False) -> list[tuple[Problem, list[dict[str, str]]]]:
    """`eval.num_problems` problems from the task's "eval" stream (of `eval.task_path`'s data when set), with
    their chat messages; empty when the job does not evaluate, unless `always` (`stableasync evaluate`)."""
    from tasks.base import TaskError

    if not (always or job.eval.every_steps or job.eval.before_training):
        return []
    if job.eval.task_path is not None:
        try:
            task = job_task(job, path=job.eval.task_path)
        except TaskError as error:
            raise TaskError(f"eval.task_path: {error}") from error
    problems = list(itertools.islice(task.problems("eval", job.seed), job.eval.num_problems))
    if not problems:
        raise TaskError(f"eval: the task {job.task.name!r} gave no evaluation problems")
    return [(problem, task.messages(problem)) for problem in problems]


@dataclasses.dataclass(frozen=True)
class EvaluationSet:
    """One set the policy answers at each evaluation, with how its answers are sampled and scored: the unnamed
    set of eval.num_problems (`name` None) logs eval/*, so earlier runs and dashboards still read; a named one
    eval/NAME/*."""

    name: str | None
    problems: list[tuple[Problem, list[dict[str, str]]]]  # with each problem's chat messages
    temperature: float
    samples_per_problem: int  # k of pass@k
    task_name: str  # the task whose verifier scores the answers, built in the reward workers from task_config
    task_config: Any
    pass_at: tuple[int, ...] = ()  # k's of the unbiased pass@k estimates (eval.pass_at)

    @property
    def label(self) -> str:
        """The set's name in `stableasync evaluate`'s table and JSON; the unnamed set is 'default'."""
        return self.name or DEFAULT_EVAL_SET

    def key(self, metric: str) -> str:
        """`metric` (an eval/* key) as this set logs it: eval/solved for the unnamed set, eval/NAME/solved else."""
        return metric if self.name is None else metric.replace("eval/", f"eval/{self.name}/", 1)


def evaluation_sets(
    job: Job, task: Task, always: bool = False, labels: Collection[str] | None = None
) -> list[EvaluationSet]:
    """Every set an evaluation answers: the unnamed one (`evaluation_set`), then each of eval.sets in the file's
    order, their files read and checked now; empty when the job does not evaluate, unless `always`. `labels`
    keeps only those sets (the unnamed one is 'default'; `stableasync evaluate --sets`)."""
    if not (always or job.eval.every_steps or job.eval.before_training):
        return []
    config = section_config(job.task, TASK_CONFIGS)
    sets = []
    if labels is None or DEFAULT_EVAL_SET in labels:
        sets.append(
            EvaluationSet(
                None,
                evaluation_set(job, task, always=True),
                job.eval.temperature,
                job.eval.samples_per_problem,
                job.task.name,
                config,
                tuple(job.eval.pass_at),
            )
        )
    return sets + [
        _named_evaluation_set(job, name, config) for name in job.eval.sets if labels is None or name in labels
    ]


def _named_evaluation_set(job: Job, name: str, job_task_config: Any) -> EvaluationSet:
    """eval.sets.NAME read by its task format: the job's task config when the format is the job's task (its
    reward, system prompt and fields carry over), else that format's defaults; the set's file and fields on top."""
    from tasks.base import TaskError, build_task
    from tasks.sources import source_problem

    spec, where = job.eval.sets[name], f"eval.sets.{name}"
    problem = source_problem(spec.path)
    if problem is not None:
        raise TaskError(f"{where}.path: {problem}")
    task_name = eval_set_task(job, name)
    assert task_name is not None, "validate_job refuses a set without a file format"
    fields = config_fields(task_name)
    overrides = {
        "path": spec.path,
        **{key: value for key, value in EVAL_SET_TASK_RESETS.items() if key in fields},
        **{key: getattr(spec, key) for key in ("prompt_field", "answer_field", "split") if getattr(spec, key)},
    }
    base = job_task_config if task_name == job.task.name else TASK_CONFIGS[task_name]()
    config = dataclasses.replace(base, **overrides)
    try:
        task = build_task(task_name, config)
    except TaskError as error:
        raise TaskError(f"{where}: {error}") from error
    problems = list(itertools.islice(task.problems("eval", job.seed), spec.num_problems))
    temperature = job.eval.temperature if spec.temperature is None else spec.temperature
    return EvaluationSet(
        name,
        [(problem, task.messages(problem)) for problem in problems],
        temperature,
        spec.samples_per_problem or job.eval.samples_per_problem,
        task_name,
        config,
        tuple(job.eval.pass_at),
    )
