"""Fuzzing the job schema: any parsed YAML gives a Job or a JobValidationError whose every error names a
field that exists in the input or the schema, never another exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.job import Job, JobValidationError, validate_job

SECTIONS = {name: field for name, field in Job.model_fields.items()}
KEYS = sorted(
    {alias or name for name, field in SECTIONS.items() for alias in [field.alias]}
    | {
        "stabilizer",
        "name",
        "max_lag",
        "num_ranks",
        "steps",
        "prompts_per_step",
        "samples_per_prompt",
        "cap",
        "tau",
        "rho_on",
        "use_baseline",
        "opob_impl",
        "max_new_tokens",
        "max_model_len",
        "num_generators",
        "zero_stage",
        "every_steps",
        "weight_sync",
        "path",
        "min_operand",
        "unknown",
    }
)
TASK_NAMES = st.sampled_from(["arithmetic", "countdown", "gsm8k", "nope"])
STABILIZER_NAMES = st.sampled_from(["none", "tis_seq", "m2po", "vcpo", "bapo", "magic"])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    TASK_NAMES,
    STABILIZER_NAMES,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS), inner, max_size=4)),
    max_leaves=12,
)
jobs = st.dictionaries(st.sampled_from(KEYS), values, max_size=8).map(
    lambda d: {**d, "task": {"name": "arithmetic"}} if "task" not in d else d
)


def _paths(data, prefix=""):
    """Every dotted key path present in the input."""
    out = {prefix.rstrip(".")} if prefix else set()
    if isinstance(data, dict):
        for key, value in data.items():
            out |= _paths(value, f"{prefix}{key}.")
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs)
def test_any_input_gives_a_job_or_errors_with_field_paths(data):
    try:
        job = validate_job(data)
    except JobValidationError as error:
        assert error.errors, "a validation error lists at least one problem"
        known = _paths(data) | set(KEYS)
        for item in error.errors:
            head = item.path.split(".")[0]
            assert item.message, item
            assert head in known or item.path.startswith(("(top level)", "cluster")), item
    else:
        assert isinstance(job, Job)


@settings(max_examples=100, deadline=None)
@given(st.one_of(scalars, st.lists(scalars, max_size=3)))
def test_a_non_mapping_document_is_one_clear_error(data):
    try:
        validate_job(data)
    except JobValidationError as error:
        assert [e.path for e in error.errors] == ["(top level)"]
