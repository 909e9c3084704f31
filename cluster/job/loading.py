"""Reading a job file with `FIELD=VALUE` overrides, and writing the resolved job back out."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from cluster.job.schema import Job
from cluster.job.schema_errors import JobError, JobValidationError
from cluster.job.validation import validate_job


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[JobError]]:
    """The job file's settings with `FIELD=VALUE` settings over them (`learner.steps=100`), each value read
    as YAML (`1e-6`, `true`, `[a, b]`, `{name: vcpo}`), and the overrides that could not be applied; the schema
    then checks the result like the file's own."""
    out = copy.deepcopy(data)
    errors = []
    for item in overrides:
        field, equals, raw = item.partition("=")
        if not equals or not field.strip():
            errors.append(JobError("--set", f"{item!r} is not FIELD=VALUE (for example learner.steps=100)"))
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            errors.append(JobError(field, f"--set value {raw!r} is not YAML: {getattr(error, 'problem', error)}"))
            continue
        *sections, name = field.strip().split(".")
        node = out
        for depth, section in enumerate(sections):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                errors.append(
                    JobError(".".join(sections[: depth + 1]), f"is a value, not a section: cannot set {field}")
                )
                break
        else:
            node[name] = value
    return out, errors


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> Job:
    """Read and validate a job YAML file, with `overrides` (FIELD=VALUE) over it; YAML syntax errors name the
    line."""
    path = Path(path)
    if not path.is_file():
        raise JobValidationError(str(path), [JobError("(file)", "no such file")])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise JobValidationError(
            str(path), [JobError(where, f"invalid YAML: {getattr(error, 'problem', error)}")]
        ) from None
    unapplied: list[JobError] = []
    if overrides and isinstance(data, dict):  # a file that is not a mapping is the schema's to report
        data, unapplied = apply_overrides(data, overrides)
    try:
        job = validate_job(data, str(path))
    except JobValidationError as error:
        raise JobValidationError(str(path), unapplied + error.errors) from None
    if unapplied:
        raise JobValidationError(str(path), unapplied)
    return job


def dump_job(job: Job) -> str:
    """The resolved job (every default filled in) as YAML."""
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True), sort_keys=False)
