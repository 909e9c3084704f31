"""The driver of one job (`stableasync train`): check, prepare, place the actors, run the asynchronous loop
(`cluster/run/loop.py`), save the trained model and write the run's summary; after a learner crash, go on
from the latest checkpoint."""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray

from actors.buffer import Ledger, keep_first_lines
from cluster.job import (
    Job,
    JobError,
    JobValidationError,
    check_sandbox,
    dump_job,
    environment_spec,
    evaluation_sets,
    job_task,
)
from cluster.run import generator_actors, learner_group, ray_cluster
from cluster.run.checkpoints import (
    CHECKPOINTS,
    MODEL,
    REFERENCE,
    ModelSaveFailed,
    readable_checkpoints,
    restore_learners,
    write_model,
)
from cluster.run.faults import LEARNER_GROUP_FAILURES, CannotResume, LearnerCrashed, learners_may_crash
from cluster.run.loop import AsyncLoop
from cluster.run.model_prep import check_lora_targets, check_tools, prepare_model, sft_samples
from cluster.run.rewards import check_reward_models
from cluster.run.specs import generator_spec, learner_spec, reference_at_rl_start
from cluster.run.stopping import StopRequest
from cluster.telemetry.metrics import SAMPLES_FILE, MetricSink
from learner.batch import collate
from tasks.base import Task

log = logging.getLogger("stableasync")


@dataclass
class RunResult:
    run_dir: Path
    steps: int
    ledger_counts: dict[str, int]
    rewards: list[float] = field(default_factory=list)
    model_dir: Path | None = None  # the trained policy, a Hugging Face model folder
    model_error: str | None = None  # why the trained policy could not be saved, and how to recover it


def create_run_dir(job: Job) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(job.logging.run_dir).expanduser() / (job.logging.run_name or f"{job.name}-{stamp}")
    run_dir.mkdir(parents=True, exist_ok=False)
    (run_dir / "job.yaml").write_text(dump_job(job))
    return run_dir


def run_job(job: Job, resume_dir: Path | None = None, stop: StopRequest | None = None) -> RunResult:
    """`train`, resumed from the latest checkpoint after a learner crash, at most `learner.max_restarts` times."""
    attempt = 0
    while True:
        try:
            return train(job, resume_dir, attempt, stop)
        except LearnerCrashed as crash:
            attempt += 1
            if attempt > job.learner.max_restarts:
                raise CannotResume(
                    f"{crash}; not resuming: {attempt - 1} restarts already "
                    f"(learner.max_restarts = {job.learner.max_restarts})"
                ) from crash
            if not readable_checkpoints(crash.run_dir):
                raise CannotResume(
                    f"{crash}; not resuming: no usable checkpoint in {crash.run_dir / CHECKPOINTS} "
                    "(set checkpoint.every_steps)"
                ) from crash
            log.warning(
                "%s; resuming %s from its latest checkpoint (restart %d of %d)",
                crash,
                crash.run_dir,
                attempt,
                job.learner.max_restarts,
            )
            resume_dir = crash.run_dir


# long: the run's life in order, under one try/finally that must reach every actor it started
def train(job: Job, resume_dir: Path | None = None, attempt: int = 0, stop: StopRequest | None = None) -> RunResult:
    """Run one job to its last step, or resume `resume_dir` from its newest usable checkpoint.

    When `stop` is requested (`cluster.run.stopping`), the run ends after the learner step in flight with a
    checkpoint and raises `JobStopped`.
    """
    candidates = readable_checkpoints(resume_dir) if resume_dir is not None else []
    if resume_dir is not None and not candidates:
        raise FileNotFoundError(f"no usable checkpoint under {resume_dir / CHECKPOINTS}")
    task = job_task(job)
    evaluation = evaluation_sets(job, task)  # a bad data file or reward function fails here, before anything starts
    model_path = prepare_model(job, task)  # and a model path that loads nothing, likewise
    check_lora_targets(job, model_path, f"the model {model_path}")
    check_reward_models(job)  # a reward model path that does not load, by its field
    check_tools(job)  # a tool file that does not load, by its entry
    check_sandbox(job)  # sandbox.isolation: namespaces that this machine cannot start
    run_dir = resume_dir if resume_dir is not None else create_run_dir(job)
    ray_cluster.connect(job.cluster.address, job.cluster.num_cpus, job.cluster.namespace, job.logging.engine_logs)
    if stop is not None:
        stop.take_signals()
    _check_resources(job)
    _check_shared_paths(run_dir, model_path)
    names = run_dir.name + (f"-restart{attempt}" if attempt else "")
    reference = run_dir / REFERENCE  # written after the warm-up; a resumed run's learners load it again
    learners = learner_group.LearnerGroup(
        learner_spec(job, model_path, reference),
        job.learner.num_ranks,
        job.learner.cpus_per_rank,
        job.learner.gpus_per_rank,
        name_prefix=names,
        placement_timeout_s=job.cluster.placement_timeout_s,
        node_resource=job.cluster.learner_resource,
    )
    # the learner's placement is reserved first (it may need a whole node); then the generators' engines load
    # while the ranks load theirs and, on a fresh run, while the ranks take the warm-up
    start_generator = _generator_starter(job, model_path, names)
    generators: dict[int, Any] = {}
    ledger = sink = loop = None
    try:
        generators = {index: start_generator(index) for index in range(job.generator.num_generators)}
        learners.wait_until_ready()
        _log_micro_batch_budgets(learners)
        state = None
        if candidates:
            with learners_may_crash("while loading a checkpoint", run_dir):
                checkpoint, state = restore_learners(learners.load_checkpoint, candidates, fatal=LEARNER_GROUP_FAILURES)
            log.info("resuming %s from %s (policy version %d)", run_dir, checkpoint.name, state.version)
            keep_first_lines(run_dir / "metrics.jsonl", state.metrics_lines)
            if state.samples_lines is not None:
                keep_first_lines(run_dir / SAMPLES_FILE, state.samples_lines)
        ledger_path = run_dir / "ledger.jsonl"
        ledger = Ledger.resume(ledger_path, state.ledger_lines) if state else Ledger(ledger_path)
        sink = MetricSink(
            run_dir,
            names + ("-resumed" if state else ""),
            job.model_dump(mode="json", by_alias=True),
            job.logging.wandb.mode,
            job.logging.wandb.project,
            job.logging.wandb.entity,
            job.logging.progress_bar,
            job.learner.steps,
            alerts=job.logging.alerts,
            warmup_steps=job.model.sft_warmup.steps,
        )
        if state is None and job.model.sft_warmup.steps:
            _sft_warmup(job, task, model_path, learners, sink)
            if reference_at_rl_start(job):  # written whole (renamed when complete), then every rank loads it
                learners.load_reference(str(write_model(reference, learners.save_model)))
        ray.get([g.ready.remote() for g in generators.values()])
        placement = _placement(learners, generators)
        loop = AsyncLoop(
            job,
            task,
            evaluation,
            learners,
            generators,
            ledger,
            sink,
            run_dir,
            start_generator,
            placement["generator_nodes"],
            stop or StopRequest(),
        )
        if state is not None:
            loop.restore(state)
        rewards = loop.run()
        model_dir, model_error = (
            _save_trained_model(run_dir, learners, sink) if job.checkpoint.save_model else (None, None)
        )
    finally:
        for closing in (ledger, sink):
            if closing is not None:
                closing.close()
        learners.shutdown()
        started = loop.pool.every_actor() if loop else []
        for generator in {id(actor): actor for actor in [*generators.values(), *started]}.values():
            generator_actors.stop_generator(generator)  # each once: the loop's members include the initial generators
    counts = ledger.counts()
    summary = {
        "steps": job.learner.steps,
        "ledger": counts,
        "rewards": rewards,
        "generator_restarts": loop.schedule.generator_restarts,
        "learner_restarts": attempt,
        "generated_tokens": loop.totals.tokens,
        "generate_s": loop.totals.generate_s,  # summed over generators
        "weight_loads": loop.totals.weight_loads,
        "weight_load_s": loop.totals.weight_load_s,  # likewise
        "generators": {"joined": loop.pool.joined, "left": loop.pool.left, **placement},  # Ray node ids
        "model": model_dir and str(model_dir),
        "model_error": model_error,
        "checkpoint_failures": loop.checkpoint_failures,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return RunResult(run_dir, job.learner.steps, counts, rewards, model_dir, model_error)


def _save_trained_model(
    run_dir: Path, learners: learner_group.LearnerGroup, sink: MetricSink
) -> tuple[Path | None, str | None]:
    """The finished run's policy as RUN_DIR/model: what users evaluate, serve or train on from (`model.path`).

    A model that cannot be written (a full disk) does not undo the finished run: (None, why) with the way to
    the newest checkpoint's weights, alerted; the run directory keeps its metrics, ledger and summary.
    """
    try:
        with learners_may_crash("while saving the trained model", run_dir):  # the resumed run saves it again
            path = write_model(run_dir / MODEL, learners.save_model)
    except ModelSaveFailed as failure:
        usable = readable_checkpoints(run_dir)
        recovery = (
            f"the newest checkpoint, {usable[0][0].name}, holds the policy of step "
            f"{usable[0][1].version}: stableasync export {run_dir} writes it as a model folder"
            if usable
            else "no checkpoint holds the weights (checkpoint.every_steps is 0 or none was written)"
        )
        why = f"{failure}; {recovery}"
        sink.alert("trained model not saved", why)
        return None, why
    log.info("trained model saved to %s", path)
    return path, None


def _sft_warmup(job: Job, task: Task, model_path: str, learners: learner_group.LearnerGroup, sink: MetricSink) -> None:
    """Teach the answer format on demonstrations before RL (the learner's own optimizer, its own LR)."""
    warmup = job.model.sft_warmup
    problems = task.problems("sft", job.seed + 1)
    ranks = job.learner.num_ranks
    for step in range(warmup.steps):
        batch = [next(problems) for _ in range(warmup.prompts_per_step)]
        samples = sft_samples(model_path, task, batch, environment_spec(job))
        per_rank = len(samples) // ranks
        shards = [collate(samples[r * per_rank : (r + 1) * per_rank], 0) for r in range(ranks)]
        metrics = learners.sft_step(shards, warmup.learning_rate)
        sink.log(-warmup.steps + step, metrics)


def _generator_starter(job: Job, model_path: str, name_prefix: str) -> Callable[[int], Any]:
    """Starts generator `index` of this job (its engine loads in the background)."""
    spec, g = generator_spec(job, model_path), job.generator
    # Elastic members are not restarted in place: a dead one leaves, and a new one joins on a free unit.
    max_restarts = 0 if g.max_generators is not None else g.max_restarts
    return functools.partial(
        generator_actors.start_generator,
        spec,
        cpus=g.cpus_per_generator,
        max_restarts=max_restarts,
        name_prefix=name_prefix,
        node_resource=job.cluster.generator_resource,
    )


def _placement(learners: learner_group.LearnerGroup, generators: dict[int, Any]) -> dict[str, Any]:
    """The Ray node id of every learner rank and generator at the start (the run's summary records it)."""
    nodes = ray.get(
        [rank.node_id.remote() for rank in learners.ranks] + [g.node_id.remote() for g in generators.values()]
    )
    return {
        "learner_nodes": nodes[: len(learners.ranks)],
        "generator_nodes": dict(zip(map(str, generators), nodes[len(learners.ranks) :])),
    }


def _log_micro_batch_budgets(learners: learner_group.LearnerGroup) -> None:
    """Each rank's micro-batch budget and why, here where the user reads (an actor's info log goes nowhere)."""
    whys = ray.get(
        [rank.__ray_call__.remote(lambda learner: learner.micro_batch_budget.why) for rank in learners.ranks]
    )
    for index, why in enumerate(whys):
        log.info("learner rank %d: %s", index, why)


def shared_path_errors(run_dir: Path, model_path: str, missing: dict[str, list[str]]) -> list[JobError]:
    """What a multi-node job needs every node to see at the driver's paths, and which nodes do not."""
    fields = {
        str(run_dir): ("logging.run_dir", "its run directory (checkpoints, the saved model)"),
        model_path: (
            "model.path",
            "the model every learner rank and generator loads (a prepared model is in "
            "STABLEASYNC_CACHE: point it at shared storage on every node)",
        ),
    }
    errors = []
    for path, (name, what) in fields.items():
        nodes = sorted(node for node, paths in missing.items() if path in paths)
        if nodes:
            errors.append(
                JobError(
                    name,
                    f"{path}, {what}, is not visible on node(s) {', '.join(nodes)}: a job on "
                    "several nodes needs it on storage every node mounts at the same path "
                    "(docs/cluster.md, Shared storage)",
                )
            )
    return errors


def _check_shared_paths(run_dir: Path, model_path: str) -> None:
    """Before any actor starts: every node sees the run directory and a local model where the driver does."""
    run_dir, local_model = run_dir.resolve(), Path(model_path).exists()  # else a hub id, which each node fetches
    model = str(Path(model_path).resolve()) if local_model else model_path
    missing = ray_cluster.paths_missing_on_nodes([str(run_dir)] + ([model] if local_model else []))
    errors = shared_path_errors(run_dir, model, missing)
    if errors:
        raise JobValidationError("cluster", errors)


def _check_resources(job: Job) -> None:
    from cluster.job import cross_field_errors

    resources = ray_cluster.cluster_resources()
    errors = cross_field_errors(job, resources)
    if errors:
        raise JobValidationError("cluster", errors)
