"""The whole job file, `Job`, assembled from its sections."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from cluster.job.sections import (
    AlgorithmSection,
    AsyncSection,
    CheckpointSection,
    ClusterSection,
    GeneratorSection,
    LearnerSection,
    LoggingSection,
    ModelSection,
    Section,
    TaskSection,
)
from cluster.job.task_sections import EnvironmentSection, EvalSection, SandboxSection, ScoringSection


class Job(Section):
    """One training job: its sections as docs/jobs.md walks through them; every field has a default but `task`."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    model: ModelSection = ModelSection()
    task: TaskSection
    scoring: ScoringSection = ScoringSection()
    generator: GeneratorSection = GeneratorSection()
    learner: LearnerSection = LearnerSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    cluster: ClusterSection = ClusterSection()
    logging: LoggingSection = LoggingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    environment: EnvironmentSection = EnvironmentSection()
    sandbox: SandboxSection = SandboxSection()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def job_section_defaults(dotted: str) -> dict[str, Any]:
    """Today's default of every key of a job section ("learner", "logging.alerts"), as job.yaml spells them:
    what readers of older runs fill in for keys those runs lack."""
    section: Any = Job
    for part in dotted.split("."):
        fields = {info.alias or name: info for name, info in section.model_fields.items()}
        if part not in fields:
            raise KeyError(f"the job schema has no section {dotted!r}")
        section = fields[part].annotation
    return section().model_dump(mode="json", by_alias=True)
