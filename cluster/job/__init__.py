"""The job file: pydantic models with `extra="forbid"`, every error reported at once with its path.

Imports no torch, ray or vllm, so `stableasync validate` runs anywhere in milliseconds. The package's parts:
`sections` and `task_sections` (the sections, the stabilizer and task ones generated from the stdlib config
dataclasses in `algorithms/config.py` and `tasks/config.py`, so defaults and field docs have one source),
`schema` (the whole `Job`), `schema_errors` (a job file's errors, the schema's in the user's words),
`validation` (the rules across fields), `loading` (a file
with overrides, and the resolved job written back) and `derived` (what the workers take from a job: its task,
tool episodes, sandbox limits and evaluation sets). Callers import from `cluster.job`.
"""

from cluster.job.derived import (
    EvaluationSet,
    check_sandbox,
    environment_spec,
    evaluation_set,
    evaluation_sets,
    job_task,
    sandbox_limits,
)
from cluster.job.loading import apply_overrides, dump_job, load_job
from cluster.job.schema import Job, job_section_defaults
from cluster.job.schema_errors import JobError, JobValidationError
from cluster.job.sections import AlertsSection, AlgorithmSection, KLSection, section_config
from cluster.job.task_sections import DEFAULT_EVAL_SET, RewardSection, SandboxSection, ScoringSection
from cluster.job.validation import cross_field_errors, validate_job

__all__ = [
    "DEFAULT_EVAL_SET",
    "AlertsSection",
    "AlgorithmSection",
    "EvaluationSet",
    "Job",
    "JobError",
    "JobValidationError",
    "KLSection",
    "RewardSection",
    "SandboxSection",
    "ScoringSection",
    "apply_overrides",
    "check_sandbox",
    "cross_field_errors",
    "dump_job",
    "environment_spec",
    "evaluation_set",
    "evaluation_sets",
    "job_section_defaults",
    "job_task",
    "load_job",
    "sandbox_limits",
    "section_config",
    "validate_job",
]
