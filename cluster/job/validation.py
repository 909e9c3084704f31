"""A job file's errors, every one at once with its dotted path: the schema's (`schema_errors`) and the rules
across fields."""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any

from pydantic import ValidationError

from cluster.job.schema import Job
from cluster.job.schema_errors import JobError, JobValidationError, schema_errors
from cluster.job.task_sections import DEFAULT_EVAL_SET, EVAL_SET_NAME, FILE_TASKS
from tasks.config import TASK_CONFIGS


def cross_field_errors(job: Job, cluster_resources: dict[str, float] | None = None) -> list[JobError]:
    """Checks that span fields: sizes divisible, resources satisfiable, options consistent; each group of rules
    beside the fields it reads, in this order (a later error on the same field is the one a reader sees last).

    `cluster_resources` (Ray's totals) adds the checks against the cluster the job is about to start on.
    """
    rules = (
        _learner_errors,
        _algorithm_errors,
        _kl_errors,
        _environment_errors,
        _fixed_lag_errors,
        _model_errors,
        _generator_errors,
        _elastic_generator_errors,
        _eval_errors,
    )
    return [error for rule in rules for error in rule(job)] + _resource_errors(job, cluster_resources)


def _learner_errors(job: Job) -> list[JobError]:
    """The learner's sizes, schedule, micro-batch budget and compilation."""
    errors: list[JobError] = []
    learner, generator = job.learner, job.generator
    if learner.prompts_per_step % learner.num_ranks:
        errors.append(
            JobError(
                "learner.prompts_per_step",
                f"{learner.prompts_per_step} prompt groups cannot be split evenly over {learner.num_ranks} ranks "
                "(each prompt group stays on one rank)",
            )
        )
    updates = learner.mini_batches * learner.epochs
    if updates > 1 and job.algorithm.proximal != "recompute":
        errors.append(
            JobError(
                "algorithm.proximal",
                f"{updates} updates per step (learner.mini_batches x "
                "learner.epochs) need recompute: after the first update the learner's policy has moved, "
                "and the later ones are clipped around the step's starting policy",
            )
        )
    groups_per_rank, rest = divmod(learner.prompts_per_step, learner.num_ranks)
    if not rest and groups_per_rank % learner.mini_batches:
        errors.append(
            JobError(
                "learner.mini_batches",
                f"{groups_per_rank} prompt groups per rank cannot be split evenly into "
                f"{learner.mini_batches} mini-batches (each prompt group stays in one)",
            )
        )
    if learner.lr_warmup_steps > learner.steps:
        errors.append(
            JobError(
                "learner.lr_warmup_steps",
                f"{learner.lr_warmup_steps} warm-up steps is more than the {learner.steps} steps",
            )
        )
    if learner.max_tokens_per_micro_batch != "auto" and learner.max_tokens_per_micro_batch < generator.max_model_len:
        errors.append(
            JobError(
                "learner.max_tokens_per_micro_batch",
                f"{learner.max_tokens_per_micro_batch} is less than one sequence may hold (generator.max_model_len "
                f"{generator.max_model_len}); raise it, or lower max_model_len",
            )
        )
    if learner.compile == "layers" and learner.zero_stage == 3:
        errors.append(
            JobError(
                "learner.compile",
                "layers is not supported with learner.zero_stage 3, whose hooks gather each layer's weights "
                "as it runs; use zero_stage 2 or compile: none",
            )
        )
    return errors


def _algorithm_errors(job: Job) -> list[JobError]:
    """Group filtering, overlong shaping, book-keeping's limits and the loss aggregation."""
    errors: list[JobError] = []
    generator = job.generator
    if job.algorithm.drop_uniform_groups and generator.samples_per_prompt == 1:
        errors.append(
            JobError(
                "algorithm.drop_uniform_groups",
                "every group of one response "
                "(generator.samples_per_prompt 1) has uniform rewards: all would be dropped",
            )
        )
    if job.algorithm.overlong_buffer_tokens > generator.max_new_tokens:
        errors.append(
            JobError(
                "algorithm.overlong_buffer_tokens",
                f"{job.algorithm.overlong_buffer_tokens} is more "
                f"than the {generator.max_new_tokens} tokens a response may have "
                "(generator.max_new_tokens)",
            )
        )
    token_terms = (job.algorithm.kl is not None and job.algorithm.kl.in_ == "loss") or job.algorithm.entropy_coef > 0
    if token_terms and getattr(job.algorithm.stabilizer, "opob_impl", None) == "bookkeeping":
        errors.append(
            JobError(
                "algorithm.stabilizer.opob_impl",
                "bookkeeping forms each sequence's whole gradient "
                "from its log-prob alone, so it cannot carry a KL term in the loss or an entropy bonus; "
                "use ghost or auto (which then takes ghost)",
            )
        )
    if job.algorithm.loss_aggregation == "constant" and job.algorithm.constant_tokens is None:
        errors.append(JobError("algorithm.constant_tokens", "required when loss_aggregation is 'constant'"))
    return errors


def _kl_errors(job: Job) -> list[JobError]:
    """A KL term that would not measure or train what it says."""
    errors: list[JobError] = []
    kl = job.algorithm.kl
    stabilizer_normalises = getattr(job.algorithm.stabilizer, "norm_by_std", None)  # VCPO forms its own advantages
    std_normalised = job.algorithm.advantage == "grpo" if stabilizer_normalises is None else stabilizer_normalises
    if kl is not None and kl.in_ == "reward" and std_normalised:
        knob = "algorithm.advantage (grpo)" if stabilizer_normalises is None else "algorithm.stabilizer.norm_by_std"
        errors.append(
            JobError(
                "algorithm.kl.in",
                f"reward subtracts the KL before {knob} divides each group by "
                "its reward std, so in a group whose rewards are equal the advantages come from KL "
                "differences alone at unit scale; with `in: reward` take an advantage without the "
                "std (dr_grpo, rloo or reinforce; norm_by_std: false for vcpo), or put the KL in "
                "the loss (`in: loss`)",
            )
        )
    if kl is not None and kl.in_ == "loss" and kl.estimator == "k1":
        errors.append(
            JobError(
                "algorithm.kl.estimator",
                "k1 as a loss term has an expected gradient of 0 (its "
                "value is log pi - log ref, whose expectation's gradient under the policy's own "
                "samples vanishes); use low_var+ or k2 in the loss, or k1 with `in: reward`",
            )
        )
    return errors


def _fixed_lag_errors(job: Job) -> list[JobError]:
    """Settings that would sample or drop a group at another lag than async.fixed_lag."""
    errors: list[JobError] = []
    generator = job.generator
    if (lag := job.async_.fixed_lag) is not None:  # what would sample or drop a group at another lag
        fixed_lag_limits = [
            ("async.max_lag", job.async_.max_lag < lag, f"{job.async_.max_lag} is below async.fixed_lag {lag}"),
            ("async.stale_policy", job.async_.stale_policy == "drop", f"async.fixed_lag {lag} needs wait"),
            ("generator.streaming", generator.streaming, f"loads weights mid-call; async.fixed_lag {lag} needs false"),
            (
                "algorithm.drop_uniform_groups",
                job.algorithm.drop_uniform_groups,
                f"a dropped group's replacement would be sampled by a later policy than async.fixed_lag {lag} allows",
            ),
        ]
        errors += [JobError(field, why) for field, refused, why in fixed_lag_limits if refused]
    return errors


def _model_errors(job: Job) -> list[JobError]:
    """LoRA's limits and the tiny model's shape."""
    errors: list[JobError] = []
    learner, generator = job.learner, job.generator
    if job.model.lora is not None:
        lora_limits = [
            (
                "learner.zero_stage",
                learner.zero_stage == 3,
                "ZeRO-3 with LoRA is not supported yet; the adapter is small, so use zero_stage 2",
            ),
            (
                "async.weight_sync",
                job.async_.weight_sync != "object_store",
                "a LoRA adapter travels through the object store only; use object_store",
            ),
            (
                "generator.streaming",
                generator.streaming,
                "streaming generators do not load LoRA adapters yet; use streaming: false",
            ),
        ]
        errors += [JobError(field, why) for field, refused, why in lora_limits if refused]
    kl = job.algorithm.kl
    if kl is not None and kl.reference == "rl_start" and job.model.lora is not None and job.model.sft_warmup.steps:
        errors.append(
            JobError(
                "algorithm.kl.reference",
                "rl_start after an SFT warm-up is not there with LoRA: the "
                "reference is the base model with the adapter switched off, the policy before the "
                "warm-up; set algorithm.kl.reference: model to measure against it",
            )
        )
    if job.model.path == "tiny" and job.model.tiny.num_heads % job.model.tiny.num_kv_heads:
        errors.append(JobError("model.tiny.num_kv_heads", "must divide num_heads"))
    return errors


def _generator_errors(job: Job) -> list[JobError]:
    """Sampling, engine sizes, weight sync and elastic generators."""
    errors: list[JobError] = []
    learner, generator = job.learner, job.generator
    if generator.top_p < 1:
        errors.append(
            JobError(
                "generator.top_p",
                f"{generator.top_p} is not supported: vLLM's log-probs of a "
                "nucleus-sampled token are renormalised over the nucleus, while the learner's are over "
                "the whole vocabulary, so every importance ratio would be biased even on-policy; use "
                "1.0 and set the sampling's spread with generator.temperature",
            )
        )
    if generator.max_new_tokens >= generator.max_model_len:
        errors.append(
            JobError(
                "generator.max_new_tokens",
                f"{generator.max_new_tokens} leaves no room for the prompt in max_model_len {generator.max_model_len}",
            )
        )
    if generator.tensor_parallel_size > 1 and generator.gpus_per_generator != generator.tensor_parallel_size:
        errors.append(
            JobError(
                "generator.tensor_parallel_size",
                f"{generator.tensor_parallel_size} GPUs per engine needs gpus_per_generator "
                f"{generator.tensor_parallel_size}, not {generator.gpus_per_generator:g}",
            )
        )
    if generator.gpus_per_generator > 1 and generator.tensor_parallel_size == 1:
        errors.append(
            JobError(
                "generator.gpus_per_generator",
                f"{generator.gpus_per_generator:g} GPUs for an engine of tensor_parallel_size 1 would leave all but "
                "one idle; set tensor_parallel_size to use them, or run more generators",
            )
        )
    if job.async_.weight_sync == "nccl" and (generator.gpus_per_generator == 0 or learner.gpus_per_rank == 0):
        errors.append(
            JobError("async.weight_sync", "nccl needs GPUs on generators and learner ranks; use object_store")
        )
    return errors


def _elastic_generator_errors(job: Job) -> list[JobError]:
    """Elastic generators (generator.max_generators): the resource they follow and a weight sync that takes them."""
    errors: list[JobError] = []
    generator = job.generator
    if generator.max_generators is not None:
        if job.cluster.generator_resource is None:
            errors.append(
                JobError(
                    "cluster.generator_resource",
                    "required when generator.max_generators is set: elastic generators follow the "
                    "nodes that offer this resource",
                )
            )
        if generator.max_generators < generator.num_generators:
            errors.append(
                JobError(
                    "generator.max_generators",
                    f"{generator.max_generators} is fewer than num_generators {generator.num_generators}",
                )
            )
        if job.async_.weight_sync != "object_store":
            errors.append(
                JobError(
                    "async.weight_sync",
                    "elastic generators (generator.max_generators) need "
                    "object_store: a collective weight group cannot take new members",
                )
            )
    return errors


def _eval_errors(job: Job) -> list[JobError]:
    """Evaluation's pass@k, sampling and data."""
    errors: list[JobError] = []
    if any(k < 1 or k > job.eval.samples_per_problem for k in job.eval.pass_at):
        errors.append(
            JobError(
                "eval.pass_at",
                f"each k must be from 1 to eval.samples_per_problem "
                f"({job.eval.samples_per_problem}): pass@k is estimated from at least k answers, "
                f"got {job.eval.pass_at}",
            )
        )
    if job.eval.samples_per_problem > 1 and job.eval.temperature == 0:
        errors.append(
            JobError(
                "eval.samples_per_problem",
                f"{job.eval.samples_per_problem} greedy answers "
                "(eval.temperature 0) would all be the same; set eval.temperature > 0, or 1 answer",
            )
        )
    if job.eval.task_path is not None and not hasattr(job.task, "path"):
        errors.append(JobError("eval.task_path", f"task {job.task.name!r} reads no data file; leave it unset"))
    errors += _eval_set_errors(job)
    return errors


def _resource_errors(job: Job, cluster_resources: dict[str, float] | None) -> list[JobError]:
    """Scoring's and the actors' CPUs, GPUs and custom resources against the cluster (Ray's totals when given)."""
    errors: list[JobError] = []
    available_cpus = cluster_resources.get("CPU", 0.0) if cluster_resources is not None else None
    available_gpus = cluster_resources.get("GPU", 0.0) if cluster_resources is not None else None
    learner, generator = job.learner, job.generator
    errors += _scoring_errors(
        job, available_cpus if available_cpus is not None else job.cluster.num_cpus, available_gpus
    )
    cpus_needed = generator.num_generators * generator.cpus_per_generator + learner.num_ranks * learner.cpus_per_rank
    gpus_needed = generator.num_generators * generator.gpus_per_generator + learner.num_ranks * learner.gpus_per_rank
    cpu_limit = available_cpus if available_cpus is not None else job.cluster.num_cpus
    if cpu_limit is not None and cpus_needed > cpu_limit:
        errors.append(
            JobError(
                "cluster.num_cpus" if available_cpus is None else "generator.num_generators",
                f"the job needs {cpus_needed:g} CPUs ({generator.num_generators} generators x "
                f"{generator.cpus_per_generator:g} + {learner.num_ranks} ranks x {learner.cpus_per_rank:g}) "
                f"but the cluster has {cpu_limit:g}",
            )
        )
    if available_gpus is not None and gpus_needed > available_gpus:
        errors.append(
            JobError(
                "generator.gpus_per_generator",
                f"the job needs {gpus_needed:g} GPUs but the cluster has {available_gpus:g}",
            )
        )
    if cluster_resources is not None:
        for field, resource, count in (
            ("cluster.generator_resource", job.cluster.generator_resource, generator.num_generators),
            ("cluster.learner_resource", job.cluster.learner_resource, learner.num_ranks),
        ):
            units = cluster_resources.get(resource, 0.0) if resource else None
            if units is not None and units < count:
                errors.append(
                    JobError(
                        field,
                        f"the job starts {count} actor(s) on nodes with resource {resource!r}, but the cluster "
                        f"offers {units:g} unit(s) of it (add such nodes, or start with fewer)",
                    )
                )
    return errors


def _environment_errors(job: Job) -> list[JobError]:
    """Tools the policy may call: a built-in name, or a user's 'FILE.py:NAME' (the file is read by `validate` and
    `train`, not here: it may be on the cluster only)."""
    from tasks.builtin_tools import BUILTIN_TOOLS  # standard library only

    errors = []
    for index, name in enumerate(job.environment.tools):
        where = f"environment.tools.{index}"
        path, colon, function = name.rpartition(":")
        if not colon and name not in BUILTIN_TOOLS:
            errors.append(
                JobError(
                    where,
                    f"unknown tool {name!r}; built-in: {', '.join(sorted(BUILTIN_TOOLS))}, or "
                    "your own as 'FILE.py:NAME' or 'module:NAME'",
                )
            )
        elif colon and (not function.isidentifier() or not path):
            errors.append(JobError(where, f"{name!r}: give a tool of your own as 'FILE.py:NAME' or 'module:NAME'"))
    if len(set(job.environment.tools)) != len(job.environment.tools):
        errors.append(JobError("environment.tools", "a tool is listed twice"))
    return errors


def eval_set_task(job: Job, name: str) -> str | None:
    """The task that reads eval set `name`'s file: its own `task`, else the job's when that reads files."""
    chosen = job.eval.sets[name].task
    return chosen if chosen is not None else (job.task.name if job.task.name in FILE_TASKS else None)


def _eval_set_errors(job: Job) -> list[JobError]:
    """eval.sets: names that fit in metric keys, a task format that reads the file, fields that format has, and
    sampled answers when there are several per problem. The files themselves are read with the task's data
    (`evaluation_sets`), so `validate --schema-only` passes a job whose data is on the cluster."""
    errors = []
    for name, spec in job.eval.sets.items():
        where = f"eval.sets.{name}"
        if not re.fullmatch(EVAL_SET_NAME, name):
            errors.append(
                JobError(
                    where, f"a set name is letters, digits, _ and - only: it becomes the metric keys eval/{name}/*"
                )
            )
        elif name == DEFAULT_EVAL_SET:
            errors.append(
                JobError(
                    where,
                    f"{DEFAULT_EVAL_SET!r} names the unnamed set of eval.num_problems "
                    "(`stableasync evaluate --sets`); pick another name",
                )
            )
        task = eval_set_task(job, name)
        if task is None:
            errors.append(
                JobError(
                    f"{where}.task",
                    f"required: the job's task {job.task.name!r} reads no data "
                    f"file; give the file's format ({', '.join(FILE_TASKS)})",
                )
            )
        else:
            errors += [
                JobError(
                    f"{where}.{key}",
                    f"the {task!r} format has no {key}; only "
                    f"{' or '.join(t for t in FILE_TASKS if key in config_fields(t))} sets read one",
                )
                for key in ("prompt_field", "answer_field")
                if getattr(spec, key) is not None and key not in config_fields(task)
            ]
        samples = spec.samples_per_problem or job.eval.samples_per_problem
        if any(k > samples for k in job.eval.pass_at):
            errors.append(
                JobError(
                    "eval.pass_at",
                    f"{max(job.eval.pass_at)} is more than the {samples} answers per "
                    f"problem of {where}: pass@k is estimated from at least k answers",
                )
            )
        temperature = job.eval.temperature if spec.temperature is None else spec.temperature
        if samples > 1 and temperature == 0:
            field = "samples_per_problem" if spec.samples_per_problem is not None else "temperature"
            errors.append(
                JobError(
                    f"{where}.{field}",
                    f"{samples} greedy answers (temperature 0) would all be the "
                    "same; set the set's temperature > 0, or 1 answer",
                )
            )
    return errors


def config_fields(task: str) -> set[str]:
    """The fields of a task's config (`tasks/config.py`)."""
    return {field.name for field in dataclasses.fields(TASK_CONFIGS[task])}


def _scoring_errors(job: Job, cpu_limit: float | None, available_gpus: float | None) -> list[JobError]:
    """scoring.rewards: one component per name (each is its own metric); room on the cluster for the reward model
    actors (one CPU each, and their GPUs) beside the generators and learner ranks."""
    rewards = job.scoring.rewards or []
    errors = [
        JobError(
            f"scoring.rewards.{i}.name",
            f"a second {r.name!r} component (one per name: each is logged as rollout/reward_{r.name}_mean)",
        )
        for i, r in enumerate(rewards)
        if r.name in {earlier.name for earlier in rewards[:i]}
    ]
    models = [(i, r) for i, r in enumerate(rewards) if r.name == "reward_model"]
    if not models:
        return errors
    generator, learner = job.generator, job.learner
    for unit, limit, others, wanted in (
        (
            "CPUs",
            cpu_limit,
            generator.num_generators * generator.cpus_per_generator + learner.num_ranks * learner.cpus_per_rank,
            [(i, 1.0) for i, _ in models],
        ),
        (
            "GPUs",
            available_gpus,
            generator.num_generators * generator.gpus_per_generator + learner.num_ranks * learner.gpus_per_rank,
            [(i, r.gpus or 0.0) for i, r in models],
        ),
    ):
        taken = sum(count for _, count in wanted)
        if limit is not None and taken and others <= limit < others + taken:
            index = next(i for i, count in wanted if count)
            errors.append(
                JobError(
                    f"scoring.rewards.{index}.{'gpus' if unit == 'GPUs' else 'name'}",
                    f"reward model actors take {taken:g} {unit} beside the {others:g} of generators "
                    f"and learner ranks, but the cluster has {limit:g}",
                )
            )
    return errors


def validate_job(data: Any, source: str = "job") -> Job:
    """A typed Job from parsed YAML, or JobValidationError listing every problem with its path."""
    if not isinstance(data, dict):
        raise JobValidationError(source, [JobError("(top level)", f"expected a mapping, got {type(data).__name__}")])
    try:
        job = Job.model_validate(data)
    except ValidationError as error:
        errors = schema_errors(error)
        raise JobValidationError(source, errors + _cross_field_errors_without(data, error, errors)) from None
    errors = cross_field_errors(job)
    if errors:
        raise JobValidationError(source, errors)
    return job


def _cross_field_errors_without(data: dict, error: ValidationError, reported: list[JobError]) -> list[JobError]:
    """Cross-field errors of the job with its invalid fields removed (defaults stand in for them),
    so one pass reports both kinds; checks touching a field already reported are left out."""
    pruned = copy.deepcopy(data)
    for item in error.errors():
        _delete(pruned, [part for part in item["loc"] if not isinstance(part, int)])
    try:
        job = Job.model_validate(pruned)
    except ValidationError:
        return []
    seen = {e.path for e in reported}
    return [e for e in cross_field_errors(job) if e.path not in seen]


def _delete(data: Any, loc: list[Any]) -> None:
    """Remove the value at `loc`; parts that are not keys (pydantic's union tags) are skipped."""
    node, parent, last = data, None, None
    for key in loc:
        if isinstance(node, dict) and key in node:
            parent, last, node = node, key, node[key]
    if parent is not None:
        del parent[last]
