"""A job file's errors: one with its dotted path (`JobError`), all of them at once (`JobValidationError`), and the
schema's in the user's words (pydantic's locations as the file's dotted paths, a misspelt key answered with
the field it meant)."""

from __future__ import annotations

import dataclasses
import difflib
import functools
from typing import Any

from pydantic import ValidationError

from algorithms.config import STABILIZER_CONFIGS
from algorithms.errors import StableAsyncError
from cluster.job.schema import Job
from tasks.config import TASK_CONFIGS


@dataclasses.dataclass(frozen=True)
class JobError:
    """One problem in a job file: the dotted field path and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class JobValidationError(StableAsyncError, ValueError):
    """All the errors of a job file at once."""

    def __init__(self, source: str, errors: list[JobError]) -> None:
        self.source, self.errors = source, errors
        lines = "\n".join(f"  {error}" for error in errors)
        super().__init__(f"{source}: {len(errors)} error(s)\n{lines}")


def schema_errors(error: ValidationError) -> list[JobError]:
    """Pydantic's errors of a job file as `JobError`s: dotted paths as the file spells them, a check's own words,
    and for a key the schema does not have, the field it most likely meant."""
    out = []
    for item in error.errors():
        loc = _user_path([str(part) for part in item["loc"]])
        message = item["msg"].removeprefix("Value error, ")  # a check's own words
        if item["type"] == "extra_forbidden" and loc:
            message += _did_you_mean(loc[-1], _fields_at(loc[:-1]))
        out.append(JobError(".".join(loc) or "(top level)", message))
    return out


def _did_you_mean(name: str, fields: set[str]) -> str:
    close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


@functools.cache
def _job_schema() -> dict[str, Any]:
    """The job's JSON schema, built once for all of a file's misspelt keys."""
    return Job.model_json_schema()


def _fields_at(path: list[str]) -> set[str]:
    """The field names the job schema allows under a dotted `path` (every member's of a union; list items by
    their index), for suggesting the one a misspelt key meant."""
    schema = _job_schema()
    definitions = schema.get("$defs", {})

    def expanded(node: dict[str, Any]) -> list[dict[str, Any]]:
        if "$ref" in node:
            return expanded(definitions[node["$ref"].rsplit("/", 1)[-1]])
        members = node.get("anyOf") or node.get("oneOf") or node.get("allOf")
        if members:
            return [leaf for member in members for leaf in expanded(member)]
        return [node]

    nodes = [schema]
    for part in path:
        inner = [
            node["items"] if part.isdigit() and "items" in node else node.get("properties", {}).get(part)
            for node in (leaf for start in nodes for leaf in expanded(start))
        ]
        nodes = [node for node in inner if node is not None] or nodes  # a union's tag: stay where it was
    return {field for start in nodes for leaf in expanded(start) for field in leaf.get("properties", {})}


def _user_path(loc: list[str]) -> list[str]:
    """Drop pydantic's union-member tags (e.g. 'tis_seq') that follow a discriminated field."""
    cleaned: list[str] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] in ("stabilizer", "task") and part in {*STABILIZER_CONFIGS, *TASK_CONFIGS}:
            continue
        cleaned.append("async" if part == "async_" else part)
    return cleaned
