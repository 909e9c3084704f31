"""The driver of one job: prepare, place actors, then run the asynchronous loop.

The loop keeps every generator busy as long as the rollout buffer admits more groups under the lag
bound, starts a learner step whenever a batch of fresh groups is ready, and after each step publishes
the new weights; a generator picks them up before its next request (Ray runs an actor's calls in
order), so it never restarts and never waits for the learner unless the lag bound says so.

A generator whose process dies is restarted by Ray (`generator.max_restarts`); the loop sends it the
latest weights first, then issues its in-flight groups again (the ledger records each reissue).

Elastic jobs (`generator.max_generators`) follow the cluster instead: a generator is started on every
free unit of `cluster.generator_resource` (a node the autoscaler added) and joins once it has the
latest weights; one whose node went away leaves, and its in-flight groups go to the others.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, OutOfMemoryError, RayActorError, RayTaskError
import torch

from actors.buffer import Ledger, RolloutBuffer, ScoredGroup, keep_first_lines
from actors.generator import GeneratedGroup, GenerationRequest, GeneratorSpec
from algorithms.config import STABILIZER_CONFIGS
from algorithms.diagnostics import lag_stats
from algorithms.errors import StableAsyncError
from algorithms.rewards import overlong_penalty
from cluster.run import runtime
from cluster.run.checkpoints import (CHECKPOINTS, MODEL, CheckpointFailed, ModelSaveFailed, readable_checkpoints,
                                 restore_learners, write_checkpoint, write_model)
from cluster.run.evaluation import Evaluator, evaluate_again_on_resume
from cluster.job import (AlgorithmSection, Job, JobError, JobValidationError, dump_job, evaluation_set, job_task,
                         section_config)
from cluster.telemetry.metrics import SAMPLES_FILE, MetricSink
from cluster.run.model_prep import prepare_model, sft_samples
from cluster.telemetry.samples import rollout_samples
from cluster.run.stopping import JobStopped, StopRequest
from learner.batch import TrainBatch, collate
from learner.rank import LearnerSpec
from tasks.base import Problem, Task
from tasks.config import TASK_CONFIGS
from tasks.scoring import ScorePool

log = logging.getLogger("stableasync")
GENERATOR_RESTART_TIMEOUT_S = 600.0  # vLLM start on a busy node, model load included
SCALE_CHECK_S = 2.0  # how often an elastic job looks for free generator resources


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


@dataclass
class Generation:
    """One generate call in flight: which generator, the groups it was sent, the weights it should use."""

    index: int
    requests: list[GenerationRequest]
    weights_version: int


@dataclass
class Member:
    """What the loop knows of one generator besides its actor (the publisher shares the actor map)."""

    weights_version: int = 0  # the policy version its next call samples with
    incarnation: str | None = None  # its process, learnt from its first result after a (re)start
    restarts: int = 0


class CannotResume(StableAsyncError, RuntimeError):
    """A learner crash the job does not come back from: restarts used up, or no checkpoint to resume."""


class GeneratorLost(StableAsyncError, RuntimeError):
    """A generator died more often than generator.max_restarts allows, did not come back, or none is left."""


class SchedulerStuck(StableAsyncError, RuntimeError):
    """The loop has nothing to wait for: no generation admitted and no batch ready (a bug, not a fault)."""


class LearnerCrashed(StableAsyncError, RuntimeError):
    """A learner rank died: the job can go on from its latest checkpoint in `run_dir`."""

    def __init__(self, message: str, run_dir: Path) -> None:
        super().__init__(message)
        self.run_dir = run_dir


# A learner rank died, or one failed while the others waited in a collective: the group cannot go on.
LEARNER_GROUP_FAILURES = (RayActorError, runtime.LearnerGroupBroken)


class LearnerOutOfMemory(StableAsyncError, RuntimeError):
    """A learner rank ran out of memory: resuming with the same settings would only run out again."""


def _out_of_memory(error: BaseException) -> bool:
    """Ray's memory monitor killed the actor, or the step raised torch's (CUDA) out-of-memory error."""
    return isinstance(error, OutOfMemoryError) or any(
        cls.__name__ == "OutOfMemoryError" for cls in type(getattr(error, "cause", None) or error).__mro__)


@contextmanager
def learners_may_crash(doing: str, run_dir: Path) -> Iterator[None]:
    """A learner rank that dies, or a group whose collectives fell out of step, `doing` something: a
    `LearnerCrashed`, so the job goes on from its latest checkpoint (a half-written .tmp is ignored).
    One that ran out of memory stops the job with the settings to lower; its checkpoints and ledger stay."""
    try:
        yield
    except (*LEARNER_GROUP_FAILURES, OutOfMemoryError, RayTaskError) as error:
        out_of_memory = _out_of_memory(error)
        if not out_of_memory and not isinstance(error, LEARNER_GROUP_FAILURES):
            raise  # the step's own error (a bad batch, a storage failure): its message says what went wrong
        if out_of_memory:
            raise LearnerOutOfMemory(
                f"a learner rank ran out of memory {doing}: lower learner.max_tokens_per_micro_batch (the tokens "
                "one forward holds) or set learner.gradient_checkpointing: true in "
                f"{run_dir / 'job.yaml'}, then `stableasync train --resume {run_dir}` goes on from its latest "
                f"checkpoint; {type(error).__name__}: "
                f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}") from error
        raise LearnerCrashed(f"a learner rank died or broke the group {doing} ({type(error).__name__}: {error})",
                             run_dir) from error


@dataclass
class ScoredSinceStep:
    """The responses scored since the last step row, trained or not: that row reports them, then they start over."""

    rewards: list[float] = field(default_factory=list)  # as trained on: the verifier's, plus any overlong penalty
    overlong_penalties: list[float] = field(default_factory=list)
    truncated: int = 0  # responses the generator cut off at max_new_tokens
    uniform_groups_dropped: int = 0  # by algorithm.drop_uniform_groups

    def metrics(self, algorithm: AlgorithmSection) -> dict[str, float]:
        """`rollout/*` keys of the step row; those of options the job leaves off are not logged."""
        def mean(values: list[float]) -> float:
            return sum(values) / len(values) if values else math.nan

        row = {"rollout/truncated_share": self.truncated / len(self.rewards) if self.rewards else math.nan}
        if algorithm.drop_uniform_groups:
            row["rollout/scored_reward_mean"] = mean(self.rewards)
            row["rollout/uniform_groups_dropped"] = self.uniform_groups_dropped
        if algorithm.overlong_buffer_tokens:
            row["rollout/overlong_penalty_mean"] = mean(self.overlong_penalties)
        return row


class RunHalted(StableAsyncError, RuntimeError):
    """The run stopped itself, with a checkpoint to resume from, for a reason the user must fix first."""


class NumericalFailure(RunHalted):
    """Too many steps in a row were skipped for non-finite values: stop, with a checkpoint to resume from."""


class UniformRewards(RunHalted):
    """With algorithm.drop_uniform_groups, too many groups in a row scored the same for every response: the
    generators would sample on forever without a learning signal."""


@dataclass
class SkipStreak:
    """Consecutive skipped steps; `record` says when the limit is reached (a finite step resets it)."""

    limit: int
    count: int = 0

    def record(self, skipped: bool) -> bool:
        self.count = self.count + 1 if skipped else 0
        return self.count >= self.limit


def reward_workers(job: Job) -> ScorePool:
    """The verifier subprocesses of the job's task, as its `scoring` section sets them."""
    scoring = job.scoring
    return ScorePool(job.task.name, section_config(job.task, TASK_CONFIGS), max_workers=scoring.workers,
                     timeout_s=scoring.timeout_s, memory_limit_mb=scoring.memory_limit_mb,
                     startup_timeout_s=scoring.startup_timeout_s)


def run_job(job: Job, resume_dir: Path | None = None, stop: StopRequest | None = None) -> RunResult:
    """`train`, resumed from the latest checkpoint after a learner crash, at most `learner.max_restarts` times."""
    attempt = 0
    while True:
        try:
            return train(job, resume_dir, attempt, stop)
        except LearnerCrashed as crash:
            attempt += 1
            if attempt > job.learner.max_restarts:
                raise CannotResume(f"{crash}; not resuming: {attempt - 1} restarts already "
                                   f"(learner.max_restarts = {job.learner.max_restarts})") from crash
            if not readable_checkpoints(crash.run_dir):
                raise CannotResume(f"{crash}; not resuming: no usable checkpoint in {crash.run_dir / CHECKPOINTS} "
                                   "(set checkpoint.every_steps)") from crash
            log.warning("%s; resuming %s from its latest checkpoint (restart %d of %d)", crash, crash.run_dir,
                        attempt, job.learner.max_restarts)
            resume_dir = crash.run_dir


def train(job: Job, resume_dir: Path | None = None, attempt: int = 0, stop: StopRequest | None = None) -> RunResult:
    """Run one job to its last step, or resume `resume_dir` from its newest usable checkpoint.

    When `stop` is requested (`cluster.run.stopping`), the run ends after the learner step in flight with a
    checkpoint and raises `JobStopped`.
    """
    candidates = readable_checkpoints(resume_dir) if resume_dir is not None else []
    if resume_dir is not None and not candidates:
        raise FileNotFoundError(f"no usable checkpoint under {resume_dir / CHECKPOINTS}")
    task = job_task(job)
    evaluation = evaluation_set(job, task)  # a bad data file or reward function fails here, before anything starts
    model_path = prepare_model(job, task)  # and a model path that loads nothing, likewise
    run_dir = resume_dir if resume_dir is not None else create_run_dir(job)
    runtime.connect(job.cluster.address, job.cluster.num_cpus, job.cluster.namespace)
    if stop is not None:
        stop.take_signals()
    _check_resources(job)
    _check_shared_paths(run_dir, model_path)
    names = run_dir.name + (f"-restart{attempt}" if attempt else "")
    learners = runtime.LearnerGroup(_learner_spec(job, model_path), job.learner.num_ranks,
                                    job.learner.cpus_per_rank, job.learner.gpus_per_rank, name_prefix=names,
                                    placement_timeout_s=job.cluster.placement_timeout_s,
                                    node_resource=job.cluster.learner_resource)
    start_generator = _generator_starter(job, model_path, names)
    generators = {index: start_generator(index) for index in range(job.generator.num_generators)}
    ray.get([g.ready.remote() for g in generators.values()])
    placement = _placement(learners, generators)
    ledger = sink = loop = None
    try:
        state = None
        if candidates:
            with learners_may_crash("while loading a checkpoint", run_dir):
                checkpoint, state = restore_learners(learners.load_checkpoint, candidates,
                                                     fatal=LEARNER_GROUP_FAILURES)
            log.info("resuming %s from %s (policy version %d)", run_dir, checkpoint.name, state["version"])
            keep_first_lines(run_dir / "metrics.jsonl", state["metrics_lines"])
            if "samples_lines" in state:  # checkpoints written before samples were logged lack it
                keep_first_lines(run_dir / SAMPLES_FILE, state["samples_lines"])
        ledger = Ledger.resume(run_dir / "ledger.jsonl", state["ledger_lines"]) if state else Ledger(run_dir / "ledger.jsonl")
        sink = MetricSink(run_dir, names + ("-resumed" if state else ""), job.model_dump(mode="json", by_alias=True),
                          job.logging.wandb.mode, job.logging.wandb.project, job.logging.wandb.entity,
                          job.logging.progress_bar, job.learner.steps, alerts=job.logging.alerts)
        if state is None and job.model.sft_warmup.steps:
            _sft_warmup(job, task, model_path, learners, sink)
        loop = AsyncLoop(job, task, evaluation, learners, generators, ledger, sink, run_dir, start_generator,
                         placement["generator_nodes"], stop or StopRequest())
        if state is not None:
            loop.restore(state)
        rewards = loop.run()
        model_dir, model_error = _save_trained_model(run_dir, learners, sink) if job.checkpoint.save_model else (
            None, None)
    finally:
        for closing in (ledger, sink):
            if closing is not None:
                closing.close()
        learners.shutdown()
        started = [actor for _, actor in loop.starting.values()] + list(loop.generators.values()) if loop else []
        for generator in {id(actor): actor for actor in [*generators.values(), *started]}.values():
            runtime.stop_generator(generator)  # each once: the loop's members include the initial generators
    counts = ledger.counts()
    summary = {"steps": job.learner.steps, "ledger": counts, "rewards": rewards,
               "generator_restarts": loop.generator_restarts, "learner_restarts": attempt,
               "generated_tokens": loop.generated_tokens, "generate_s": loop.generate_s,  # summed over generators
               "weight_loads": loop.weight_loads, "weight_load_s": loop.weight_load_s,  # likewise
               "generators": {"joined": loop.joined, "left": loop.left, **placement},  # nodes by Ray node id
               "model": model_dir and str(model_dir), "model_error": model_error,
               "checkpoint_failures": loop.checkpoint_failures}
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return RunResult(run_dir, job.learner.steps, counts, rewards, model_dir, model_error)


def _save_trained_model(run_dir: Path, learners: runtime.LearnerGroup,
                        sink: MetricSink) -> tuple[Path | None, str | None]:
    """The finished run's policy as RUN_DIR/model: what users evaluate, serve or train on from (`model.path`).

    A model that cannot be written (a full disk) does not undo the finished run: (None, why) with the way to
    the newest checkpoint's weights, alerted; the run directory keeps its metrics, ledger and summary.
    """
    try:
        with learners_may_crash("while saving the trained model", run_dir):  # the resumed run saves it again
            path = write_model(run_dir / MODEL, learners.save_model)
    except ModelSaveFailed as failure:
        usable = readable_checkpoints(run_dir)
        recovery = (f"the newest checkpoint, {usable[0][0].name}, holds the policy of step "
                    f"{usable[0][1]['version']}: stableasync export {run_dir} writes it as a model folder" if usable
                    else "no checkpoint holds the weights (checkpoint.every_steps is 0 or none was written)")
        why = f"{failure}; {recovery}"
        sink.alert("trained model not saved", why)
        return None, why
    log.info("trained model saved to %s", path)
    return path, None


class AsyncLoop:
    """Generators, scorer, buffer and learner, driven by completions (`ray.wait`)."""

    def __init__(self, job: Job, task: Task, evaluation: list[tuple[Problem, list[dict[str, str]]]],
                 learners: runtime.LearnerGroup, generators: dict[int, Any],
                 ledger: Ledger, sink: MetricSink, run_dir: Path, start_generator: Callable[[int], Any],
                 generator_nodes: dict[str, str], stop: StopRequest) -> None:
        self.job, self.task, self.learners, self.sink = job, task, learners, sink
        self.stop = stop
        self.generators = dict(generators)  # index -> actor; elastic jobs add and remove members
        self.run_dir = run_dir
        self.start_generator = start_generator
        self.elastic = job.generator.max_generators is not None
        sync, dtype = job.async_.weight_sync, job.model.dtype_on(gpu=job.generator.gpus_per_generator > 0)
        self.publisher = (runtime.ObjectStorePublisher(learners, self.generators, dtype) if sync == "object_store"
                          else runtime.CollectivePublisher(learners, self.generators, sync, dtype,
                                                           job.generator.tensor_parallel_size))
        self.buffer = RolloutBuffer(job.async_.max_lag, job.learner.prompts_per_step, job.async_.stale_policy, ledger,
                                    job.algorithm.drop_uniform_groups)
        self.scored = ScoredSinceStep()
        self.problems: Iterator[Problem] = task.problems("train", job.seed)
        self.problem_of: dict[int, Problem] = {}
        self.problems_drawn = 0
        self.resumed_requests: list[GenerationRequest] = []
        self.scorer = reward_workers(job)
        self.rng = random.Random(job.seed)
        self.next_group_id = 0
        self.version = 0  # learner optimizer steps taken
        self.members = {index: Member() for index in generators}
        self.generating: dict[ray.ObjectRef, Generation] = {}  # generate call -> what it was asked
        self.starting: dict[ray.ObjectRef, tuple[int, Any]] = {}  # elastic newcomers: ready call -> (index, actor)
        self.orphans: list[tuple[GenerationRequest, str]] = []  # groups of generators that left, with why
        self.next_generator_index = max(generators, default=-1) + 1
        self.next_scale_check = 0.0
        self.alone_since: float | None = None
        self.joined = self.left = 0
        self.departed_restarts = 0  # restarts of generators that have left the job
        self.generated_tokens, self.generate_s = 0, 0.0  # over every generate call of this run
        self.weight_loads, self.weight_load_s = 0, 0.0  # generators' own weight loads, reported with their calls
        self.generator_busy_s = 0.0  # generate calls and weight loads reported since the last step row
        self.generator_nodes = generator_nodes  # index (str) -> Ray node id, newcomers added as they join
        self.learner_refs: list[ray.ObjectRef] = []
        self.training: list[ScoredGroup] = []
        self.step_started = 0.0
        self.pad_id = 0
        self.rewards: list[float] = []
        self.skips = SkipStreak(job.learner.max_skipped_steps_in_a_row)
        self.checkpoint_failures = 0
        self.evaluator = Evaluator(evaluation, job.eval.temperature, job.eval.samples_per_problem, job.seed,
                                   self.scorer, sink)
        self.evaluations_to_redo: list[int] = []  # policy versions a checkpoint was still evaluating
        self.resumed = False  # restored from a checkpoint (set by restore)

    @property
    def generator_restarts(self) -> int:
        """Generator restarts over the run, of members and of generators that left."""
        return self.departed_restarts + sum(m.restarts for m in self.members.values())

    def run(self) -> list[float]:
        self._sync_weights()  # generators start from the learner's weights (after any warm-up or resume)
        if self.job.eval.before_training and not self.resumed:  # a resume redoes only what was in flight
            self._start_evaluation()
        self._redo_evaluations()
        self._reissue_resumed()
        try:
            while self.version < self.job.learner.steps:
                if self.stop.requested:  # nothing new starts; the learner step in flight finishes
                    if not self.learner_refs:
                        raise self._stopped()
                else:
                    self._scale_generators()
                    self._issue_generation()
                    self._start_learner_step()
                self._handle(self._wait_one())
                self._check_uniform_streak()
            self.evaluator.wait()  # the last step's evaluation
        finally:
            self.scorer.close()
        self._end_unfinished_groups("run finished", wait_for_generation=True)
        return self.rewards

    def _stopped(self) -> JobStopped:
        """Checkpoint the run where it stands, which holds the groups in flight and buffered; the ledger
        ends them as dropped (a resume cuts it back to the checkpoint and picks them up again)."""
        checkpoint = self._checkpoint()
        self.evaluator.abandon(f"the run stopped (a resume from {checkpoint.name} evaluates again what it was "
                               "evaluating)")
        self._end_unfinished_groups(f"run stopped by {self.stop.signal_name} at step {self.version} (resumable)",
                                    wait_for_generation=False)
        return JobStopped(self.stop.signal_name, self.version, checkpoint, self.run_dir)

    def _end_unfinished_groups(self, why: str, wait_for_generation: bool) -> None:
        """Record in the ledger that every group still generating, orphaned or buffered ends untrained."""
        for ref in list(self.generating):
            call = self.generating.pop(ref)
            if wait_for_generation:  # let it finish before its generator is killed
                try:
                    ray.get(ref)
                except RayActorError:
                    pass
            for request in call.requests:
                self.buffer.lost(request.group_id, f"{why} before this group was trained")
        for request, reason in self.orphans:
            self.buffer.lost(request.group_id, f"{why} before this group was issued again ({reason})")
        for group in self.buffer.ready:
            self.buffer.ledger.dropped(group.group_id, f"{why} before this group was trained")

    # ---- one turn of the loop ------------------------------------------------------------------

    def _issue_generation(self) -> None:
        busy = {call.index for call in self.generating.values()}
        for index in self.generators:
            if index in busy:
                continue
            if self.orphans:  # groups of a generator that left go first, to whoever is free
                self._adopt_orphans(index)
                continue
            requests = []
            while len(requests) < self.job.generator.prompts_per_request and self.buffer.can_issue(
                self.version, bool(self.learner_refs), self.members[index].weights_version
            ):
                requests.append(self._new_request(index))
            if requests:
                self._send(index, requests)

    def _adopt_orphans(self, index: int) -> None:
        """Give generator `index` the next request's worth of groups whose generator left the job."""
        size = self.job.generator.prompts_per_request
        adopted, self.orphans = self.orphans[:size], self.orphans[size:]
        for request, reason in adopted:
            self.buffer.reissue(request.group_id, self.members[index].weights_version, index, reason)
        self._send(index, [request for request, _ in adopted])

    def _send(self, index: int, requests: list[GenerationRequest]) -> None:
        ref = self.generators[index].generate.remote(requests)
        self.generating[ref] = Generation(index, requests, self.members[index].weights_version)

    def _new_request(self, generator_index: int) -> GenerationRequest:
        problem = next(self.problems)
        self.problems_drawn += 1
        group_id, self.next_group_id = self.next_group_id, self.next_group_id + 1
        self.problem_of[group_id] = problem
        self.buffer.issue(group_id, problem.problem_id, self.members[generator_index].weights_version, generator_index)
        return GenerationRequest(group_id, problem.problem_id, self.task.messages(problem), self.rng.getrandbits(31))

    def _start_learner_step(self) -> None:
        if self.learner_refs:
            return
        groups = self.buffer.take(self.version)
        if groups is None:
            return
        self.training, self.step_started = groups, time.perf_counter()
        self.learner_refs = self.learners.train_step(self._shards(groups))

    def _wait_one(self) -> ray.ObjectRef | None:
        """The next finished call; None when an elastic job should look at the cluster again first.

        A stopping run waits for its learner step only: what is still generating goes out again on resume.
        """
        if self.stop.requested:
            return ray.wait(self.learner_refs, num_returns=1)[0][0]
        # every rank's ref: a rank that raises wakes the loop even while the others wait in a collective
        pending = list(self.generating) + self.learner_refs + list(self.starting) + list(self.evaluator.running)
        if not pending and not self.elastic:
            raise SchedulerStuck("nothing to wait for: the buffer admits no generation and no batch is ready")
        if not pending:  # every generator left: wait for a node to come back, for a while
            self.alone_since = self.alone_since or time.monotonic()
            if time.monotonic() - self.alone_since > GENERATOR_RESTART_TIMEOUT_S:
                raise GeneratorLost(f"no generator for {GENERATOR_RESTART_TIMEOUT_S:g} s: no node offers a free "
                                   f"{self.job.cluster.generator_resource!r} unit (cluster.generator_resource)")
            time.sleep(SCALE_CHECK_S)
            return None
        self.alone_since = None
        ready, _ = ray.wait(pending, num_returns=1, timeout=SCALE_CHECK_S if self.elastic else None)
        return ready[0] if ready else None

    def _handle(self, ref: ray.ObjectRef | None) -> None:
        if ref is None:
            return
        if ref in self.generating:
            self._handle_generation(ref)
            return
        if ref in self.starting:
            self._join(ref)
            return
        if ref in self.evaluator.running:
            self.evaluator.finish(ref)
            return
        with learners_may_crash(f"during step {self.version + 1}", self.run_dir):
            metrics = self.learners.results(self.learner_refs, "train_step")[0]
        self.learner_refs = []
        skipped = metrics.get("stability/skipped_step", 0.0) > 0
        if skipped:  # the weights did not move: these groups were not trained on, and the ledger says so
            for group in self.training:
                self.buffer.ledger.dropped(group.group_id, f"step {self.version + 1} skipped: non-finite loss or "
                                           "importance weights")
        else:
            self.buffer.mark_trained(self.training, self.version)
        lags = [self.version - g.version_start for g in self.training for _ in g.completions]
        self.version += 1
        sync_s = self._sync_weights()
        step_s = time.perf_counter() - self.step_started
        eval_wait_s = self._start_evaluation() if self._due(self.job.eval.every_steps) else 0.0
        self._log_step(metrics, lags, sync_s, step_s, eval_wait_s)
        if self._due(self.job.logging.samples.every_steps):
            self._log_samples()
        if self._due(self.job.checkpoint.every_steps):
            self._periodic_checkpoint()
        self._check_skipped(skipped)

    def _log_samples(self) -> None:
        """A few of the step's groups, from rank 0's shard (the first groups), with the learner's log-ratios."""
        settings = self.job.logging.samples
        rank0_groups = self._rank_shares(self.training)[0]
        samples = rollout_samples(self.version, self.version - 1, rank0_groups[:settings.groups],
                                  self.learners.sequence_log_ratios(), settings.max_chars)
        self.sink.log_samples(self.version, samples)

    def _due(self, every_steps: int) -> bool:
        """Whether something done every N steps and at the last (checkpoints, evaluation) is due now; 0: never."""
        return bool(every_steps) and (self.version % every_steps == 0 or self.version == self.job.learner.steps)

    def _redo_evaluations(self) -> None:
        """On resume: evaluate again what the checkpoint was still evaluating (its row came after the cut), if
        the weights are the ones just restored."""
        if evaluate_again_on_resume(self.evaluations_to_redo, self.version):
            self._start_evaluation()
        self.evaluations_to_redo = []

    def _start_evaluation(self) -> float:
        """The policy just published answers the fixed evaluation set on one generator while the loop goes on
        (`cluster.run.evaluation`); its row is logged when the answers are scored. Returns the seconds the loop
        waited for the evaluation before it."""
        return self.evaluator.start(self.generators, [call.index for call in self.generating.values()], self.version)

    def _check_skipped(self, skipped: bool) -> None:
        """Alert on every skipped step; stop with a checkpoint after too many in a row."""
        stop = self.skips.record(skipped)
        if skipped:
            self.sink.alert("learner step skipped", f"step {self.version}: non-finite loss or importance weights on a "
                            f"learner rank; weights unchanged ({self.skips.count} in a row)")
        if stop:
            path = self._checkpoint()
            raise NumericalFailure(
                f"{self.skips.count} steps in a row had non-finite loss or importance weights "
                f"(learner.max_skipped_steps_in_a_row = {self.skips.limit}); checkpoint at {path}. Fix the cause "
                f"(learning rate, data, stabilizer), then: stableasync train --resume {self.run_dir}"
            )

    def _check_uniform_streak(self) -> None:
        """Stop with a checkpoint once algorithm.max_uniform_groups_in_a_row groups in a row were dropped for
        uniform rewards; only between learner steps, so the checkpoint holds every group still to train."""
        limit = self.job.algorithm.max_uniform_groups_in_a_row
        if self.buffer.uniform_in_a_row < limit or self.learner_refs:
            return
        path = self._checkpoint()
        self._end_unfinished_groups(f"run halted at step {self.version} (resumable)", wait_for_generation=False)
        raise UniformRewards(
            f"{self.buffer.uniform_in_a_row} prompt groups in a row were dropped because every response scored the "
            f"same (algorithm.max_uniform_groups_in_a_row = {limit}): the policy solves every problem it draws "
            f"always or never (a task too easy or too hard for it, or a policy that stopped exploring: see "
            f"stability/entropy), so no step can fill; checkpoint at {path}. Change the problems or "
            f"generator.temperature, or set algorithm.drop_uniform_groups: false in {self.run_dir / 'job.yaml'}, then: "
            f"stableasync train --resume {self.run_dir}"
        )

    def _handle_generation(self, ref: ray.ObjectRef) -> None:
        call = self.generating.pop(ref)
        index = call.index
        try:
            groups = ray.get(ref)
        except RayActorError as error:
            if self.elastic:
                self._leave(index, call.requests, f"generator {index} left during generation ({type(error).__name__})")
                return
            self._restarted(index, f"generator {index} died during generation ({type(error).__name__})")
            self._reissue(index, call.requests, f"generator {index} died during generation")
            return
        member = self.members[index]
        if groups and groups[0].incarnation != member.incarnation:
            if member.incarnation is not None:  # restarted while idle: only its first call can tell
                self._restarted(index, f"generator {index} was restarted between calls")
                if any(g.version_start < call.weights_version for g in groups):
                    self._reissue(index, call.requests,
                                  f"generator {index} sampled with its initial weights after a restart")
                    return
            member.incarnation = groups[0].incarnation
        if groups:
            self.generate_s += groups[0].generate_s
            self.weight_loads += groups[0].weight_loads
            self.weight_load_s += groups[0].weight_load_s
            self.generator_busy_s += groups[0].generate_s + groups[0].weight_load_s
            self.generated_tokens += sum(len(c["completion_ids"]) for g in groups for c in g.completions)
        requests = {request.group_id: request for request in call.requests}
        for group in groups:
            self._score_and_buffer(group, requests[group.group_id])

    def _restarted(self, index: int, reason: str) -> None:
        """Count a generator restart (fail the job past max_restarts) and give it the latest weights."""
        member = self.members[index]
        member.restarts += 1
        limit = self.job.generator.max_restarts
        if member.restarts > limit:
            raise GeneratorLost(f"{reason}; it has died {member.restarts} times, more than "
                               f"generator.max_restarts = {limit}")
        log.warning("%s; restart %d of %d: waiting for it, then weights version %d, then its groups again",
                    reason, member.restarts, limit, self.version)
        self._wait_until_back(index, reason)
        member.weights_version = self.publisher.restore(index)
        member.incarnation = None  # learnt again from its next result

    # ---- elastic generators ----------------------------------------------------------------------------

    def _scale_generators(self) -> None:
        """Start a generator on every free unit of the generator resource, up to generator.max_generators."""
        if not self.elastic or time.monotonic() < self.next_scale_check:
            return
        self.next_scale_check = time.monotonic() + SCALE_CHECK_S
        free = ray.available_resources().get(self.job.cluster.generator_resource, 0.0)
        for _ in range(generators_to_start(free, len(self.generators), len(self.starting),
                                           self.job.generator.max_generators)):
            index, self.next_generator_index = self.next_generator_index, self.next_generator_index + 1
            actor = self.start_generator(index)
            self.starting[actor.ready.remote()] = (index, actor)
            log.info("generator %d starting on a free %r unit", index, self.job.cluster.generator_resource)

    def _join(self, ref: ray.ObjectRef) -> None:
        """A started generator becomes a member once it holds the latest weights (sent before any request)."""
        index, actor = self.starting.pop(ref)
        try:
            ray.get(ref)
        except RayActorError as error:
            log.warning("generator %d failed to start (%s); trying again when resources are free", index,
                        type(error).__name__)
            return
        self.generators[index] = actor
        self.members[index] = Member(weights_version=self.publisher.restore(index))
        self.generator_nodes[str(index)] = ray.get(actor.node_id.remote())
        self.joined += 1
        log.info("generator %d joined with weights version %d (%d generators)", index, self.members[index].weights_version,
                 len(self.generators))

    def _leave(self, index: int, requests: list[GenerationRequest], reason: str) -> None:
        """A generator that died (its node left) stops being a member; its groups wait for another one."""
        self.generators.pop(index, None)
        self.departed_restarts += self.members.pop(index, Member()).restarts
        self.orphans += [(request, reason) for request in requests]
        self.left += 1
        log.warning("%s; %d generators left, %d of its groups issued again to others", reason, len(self.generators),
                    len(requests))

    def _wait_until_back(self, index: int, reason: str) -> None:
        """Block until Ray has restarted the generator (calls sent earlier fail as 'unavailable')."""
        deadline = time.monotonic() + GENERATOR_RESTART_TIMEOUT_S
        while True:
            try:
                ray.get(self.generators[index].ready.remote(), timeout=max(1.0, deadline - time.monotonic()))
                return
            except ActorDiedError as error:
                raise GeneratorLost(f"{reason}, and Ray could not restart it: {error}") from error
            except (RayActorError, GetTimeoutError) as error:
                if time.monotonic() > deadline:
                    raise GeneratorLost(f"{reason}, and it was not back within {GENERATOR_RESTART_TIMEOUT_S:g} s") from error
                time.sleep(0.5)

    def _reissue(self, index: int, requests: list[GenerationRequest], reason: str) -> None:
        for request in requests:
            self.buffer.reissue(request.group_id, self.members[index].weights_version, index, reason)
        self._send(index, requests)

    # ---- checkpoints --------------------------------------------------------------------------------

    def _periodic_checkpoint(self) -> None:
        """A periodic checkpoint that fails (a full disk, a quota, storage away for a moment) is an alert, not
        the end of a long run: training goes on, and the next one is tried at its step."""
        try:
            self._checkpoint()
        except CheckpointFailed as failure:
            self.checkpoint_failures += 1
            usable = readable_checkpoints(self.run_dir)
            newest = usable[0][0].name if usable else "none yet"
            self.sink.alert("checkpoint failed", f"{failure}. Training goes on; the newest usable checkpoint is "
                            f"{newest} (failed so far: {self.checkpoint_failures})")

    def _checkpoint(self) -> Path:
        with learners_may_crash(f"while checkpointing step {self.version}", self.run_dir):
            return write_checkpoint(self.run_dir, self.version, self.job.checkpoint.keep,
                                    self.learners.save_checkpoint, self._state())

    def _state(self) -> dict[str, Any]:
        rng_version, rng_internal, rng_gauss = self.rng.getstate()
        in_flight = [request for call in self.generating.values() for request in call.requests]
        in_flight += [request for request, _ in self.orphans]
        return {
            "version": self.version, "next_group_id": self.next_group_id, "problems_drawn": self.problems_drawn,
            "rng": [rng_version, list(rng_internal), rng_gauss],
            "ready": [asdict(group) for group in self.buffer.ready],
            "in_flight": [{"request": asdict(r), "problem": asdict(self.problem_of[r.group_id])} for r in in_flight],
            "rewards": self.rewards, "restarts": sorted((index, m.restarts) for index, m in self.members.items()),
            "evaluating": self.evaluator.steps_running(),
            "ledger_lines": self.buffer.ledger.lines, "metrics_lines": self.sink.lines,
            "samples_lines": self.sink.sample_lines,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's driver state (the learner is restored separately)."""
        self.version, self.next_group_id = state["version"], state["next_group_id"]
        for _ in range(state["problems_drawn"]):
            next(self.problems)
        self.problems_drawn = state["problems_drawn"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.buffer.ready.extend(ScoredGroup(**group) for group in state["ready"])
        self.rewards = list(state["rewards"])
        self.resumed = True
        self.evaluations_to_redo = list(state.get("evaluating", []))  # checkpoints before it lack the key
        for index, count in state["restarts"]:
            if index in self.members:
                self.members[index].restarts = count
        for item in state["in_flight"]:
            request = GenerationRequest(**item["request"])
            self.problem_of[request.group_id] = Problem(**item["problem"])
            self.resumed_requests.append(request)

    def _reissue_resumed(self) -> None:
        """Groups that were being generated at the checkpoint go out again, spread over the generators."""
        size = self.job.generator.prompts_per_request
        requests, self.resumed_requests = self.resumed_requests, []
        indices = list(self.generators)
        for n, start in enumerate(range(0, len(requests), size)):
            index = indices[n % len(indices)]
            chunk = requests[start:start + size]
            self.buffer.in_flight += len(chunk)
            self._reissue(index, chunk, f"resumed from the checkpoint at step {self.version}")

    # ---- pieces -----------------------------------------------------------------------------------

    def _score_and_buffer(self, group: GeneratedGroup, request: GenerationRequest) -> None:
        """Score a generated group into the buffer; a stopping run keeps its request to issue again on resume."""
        problem = self.problem_of[group.group_id]
        texts = [c["text"] for c in group.completions]
        results = None if self.stop.requested else self.scorer.score_many([problem] * len(texts), texts)
        if results is None or self.stop.requested:  # a stop during scoring may have reached the verifiers too
            self.orphans.append((request, "generated while the run was stopping"))
            return
        del self.problem_of[group.group_id]
        algorithm = self.job.algorithm
        penalties = [overlong_penalty(len(c["completion_ids"]), self.job.generator.max_new_tokens,
                                      algorithm.overlong_buffer_tokens, algorithm.overlong_penalty)
                     for c in group.completions]
        completions = [{**c, "reward": r.reward + penalty, "score_error": r.error}
                       for c, r, penalty in zip(group.completions, results, penalties)]
        errors = sum(r.error is not None for r in results)
        self.scored.rewards += [c["reward"] for c in completions]
        self.scored.overlong_penalties += penalties
        self.scored.truncated += sum(c["finish_reason"] == "length" for c in completions)
        scored = ScoredGroup(group.group_id, group.problem_id, group.prompt_ids, completions, group.version_start,
                             group.version_end, group.generator_index, problem.question, problem.answer)
        self.scored.uniform_groups_dropped += not self.buffer.add(scored, errors)

    def _rank_shares(self, groups: list[ScoredGroup]) -> list[list[ScoredGroup]]:
        """Whole prompt groups split over the ranks, in order (group statistics stay on one rank)."""
        ranks = self.job.learner.num_ranks
        per_rank = len(groups) // ranks
        return [groups[r * per_rank:(r + 1) * per_rank] for r in range(ranks)]

    def _shards(self, groups: list[ScoredGroup]) -> list[TrainBatch]:
        """Each rank's share of the groups as its training batch."""
        return [collate([s for g in share for s in g.samples()], self.pad_id) for share in self._rank_shares(groups)]

    def _sync_weights(self) -> float:
        """Publish the learner's weights; each generator loads them before its next request."""
        start = time.perf_counter()
        with learners_may_crash("while publishing weights", self.run_dir):
            self.publisher.publish(self.version)
        for member in self.members.values():
            member.weights_version = self.version
        return time.perf_counter() - start

    def _log_step(self, metrics: dict[str, float], lags: list[int], publish_s: float, step_s: float,
                  eval_wait_s: float) -> None:
        stats = lag_stats(torch.tensor(lags), self.job.async_.max_lag)
        row = {
            **metrics,
            "async/lag_mean": float(stats["lag_mean"]),
            "async/lag_max": float(stats["lag_max"]),
            "async/lag": [int(c) for c in stats["lag_hist"].tolist()],
            "async/buffered_groups": len(self.buffer.ready),
            "perf/weight_sync_s": publish_s,
            "perf/weight_load_s": self.weight_load_s / self.weight_loads if self.weight_loads else math.nan,
            # one generator's mean rate over all calls so far, times the generators running now
            "perf/gen_tokens_per_s": (self.generated_tokens / self.generate_s * len(self.generators)
                                      if self.generate_s else math.nan),
            "fault/generator_restarts": self.generator_restarts,
            "async/num_generators": len(self.generators),
            "time/step_s": step_s,
            "time/generator_busy_s": self.generator_busy_s,
            "time/eval_wait_s": eval_wait_s,  # the loop held up by the previous evaluation
        }
        row.update(self.scored.metrics(self.job.algorithm))
        self.scored = ScoredSinceStep()
        self.generator_busy_s = 0.0
        self.rewards.append(metrics.get("rollout/reward_mean", math.nan))
        self.sink.log(self.version, row)


def _sft_warmup(job: Job, task: Task, model_path: str, learners: runtime.LearnerGroup, sink: MetricSink) -> None:
    """Teach the answer format on demonstrations before RL (the learner's own optimizer, its own LR)."""
    warmup = job.model.sft_warmup
    problems = task.problems("sft", job.seed + 1)
    ranks = job.learner.num_ranks
    for step in range(warmup.steps):
        batch = [next(problems) for _ in range(warmup.prompts_per_step)]
        samples = sft_samples(model_path, task, batch)
        per_rank = len(samples) // ranks
        shards = [collate(samples[r * per_rank:(r + 1) * per_rank], 0) for r in range(ranks)]
        metrics = learners.sft_step(shards, warmup.learning_rate)
        sink.log(-warmup.steps + step, metrics)


def generators_to_start(free_units: float, members: int, starting: int, max_generators: int) -> int:
    """How many generators an elastic job starts now. None while others are still starting: a unit Ray
    has not yet handed to a starting actor still looks free, and must not be counted twice."""
    if starting:
        return 0
    return max(0, min(int(free_units), max_generators - members))


def _generator_starter(job: Job, model_path: str, name_prefix: str) -> Callable[[int], Any]:
    """Starts generator `index` of this job (its engine loads in the background)."""
    spec, g = _generator_spec(job, model_path), job.generator
    # Elastic members are not restarted in place: a dead one leaves, and a new one joins on a free unit.
    max_restarts = 0 if g.max_generators is not None else g.max_restarts
    return functools.partial(runtime.start_generator, spec, cpus=g.cpus_per_generator, max_restarts=max_restarts,
                             name_prefix=name_prefix, node_resource=job.cluster.generator_resource)


def _placement(learners: runtime.LearnerGroup, generators: dict[int, Any]) -> dict[str, Any]:
    """The Ray node id of every learner rank and generator at the start (the run's summary records it)."""
    nodes = ray.get([rank.node_id.remote() for rank in learners.ranks] + [g.node_id.remote() for g in generators.values()])
    return {"learner_nodes": nodes[:len(learners.ranks)],
            "generator_nodes": dict(zip(map(str, generators), nodes[len(learners.ranks):]))}


def _learner_spec(job: Job, model_path: str) -> LearnerSpec:
    stabilizer = job.algorithm.stabilizer
    return LearnerSpec(
        model_path=model_path, zero_stage=job.learner.zero_stage, learning_rate=job.learner.learning_rate,
        total_steps=job.learner.steps, lr_warmup_steps=job.learner.lr_warmup_steps,
        lr_schedule=job.learner.lr_schedule, lr_min_ratio=job.learner.lr_min_ratio,
        weight_decay=job.learner.weight_decay, adam_eps=job.learner.adam_eps,
        grad_clip=job.learner.grad_clip,
        temperature=job.generator.temperature, stabilizer_name=stabilizer.name,
        stabilizer_config=section_config(stabilizer, STABILIZER_CONFIGS), advantage=job.algorithm.advantage,
        loss_aggregation=job.algorithm.loss_aggregation, constant_tokens=job.algorithm.constant_tokens,
        dtype=job.model.dtype_on(gpu=job.learner.gpus_per_rank > 0), seed=job.seed,
        backend="nccl" if job.learner.gpus_per_rank else "gloo",
        max_tokens_per_micro_batch=job.learner.max_tokens_per_micro_batch,
        gradient_checkpointing=job.learner.gradient_checkpointing,
    )


# async.weight_sync -> the vLLM weight-transfer engine that loads the weights in each generator
WEIGHT_TRANSFER_ENGINES = {"object_store": "stableasync_packed", "gloo": "stableasync_gloo", "nccl": "nccl"}


def _generator_spec(job: Job, model_path: str) -> GeneratorSpec:
    g = job.generator
    return GeneratorSpec(
        model_path=model_path, samples_per_prompt=g.samples_per_prompt, max_new_tokens=g.max_new_tokens,
        temperature=g.temperature, top_p=g.top_p, max_model_len=g.max_model_len, kv_cache_mb=g.kv_cache_mb,
        dtype=job.model.dtype_on(gpu=g.gpus_per_generator > 0), seed=job.seed, gpus=g.gpus_per_generator,
        tensor_parallel_size=g.tensor_parallel_size, gpu_memory_utilization=g.gpu_memory_utilization,
        cuda_graphs=g.cuda_graphs, prefix_caching=g.prefix_caching, max_num_seqs=g.max_num_seqs,
        weight_transfer=WEIGHT_TRANSFER_ENGINES[job.async_.weight_sync],
    )


def shared_path_errors(run_dir: Path, model_path: str, missing: dict[str, list[str]]) -> list[JobError]:
    """What a multi-node job needs every node to see at the driver's paths, and which nodes do not."""
    fields = {str(run_dir): ("logging.run_dir", "its run directory (checkpoints, the saved model)"),
              model_path: ("model.path", "the model every learner rank and generator loads (a prepared model is in "
                                         "STABLEASYNC_CACHE: point it at shared storage on every node)")}
    errors = []
    for path, (field, what) in fields.items():
        nodes = sorted(node for node, paths in missing.items() if path in paths)
        if nodes:
            errors.append(JobError(field, f"{path}, {what}, is not visible on node(s) {', '.join(nodes)}: a job on "
                                          "several nodes needs it on storage every node mounts at the same path "
                                          "(docs/cluster.md, Shared storage)"))
    return errors


def _check_shared_paths(run_dir: Path, model_path: str) -> None:
    """Before any actor starts: every node sees the run directory and a local model where the driver does."""
    run_dir, local_model = run_dir.resolve(), Path(model_path).exists()  # else a hub id, which each node fetches
    model = str(Path(model_path).resolve()) if local_model else model_path
    missing = runtime.paths_missing_on_nodes([str(run_dir)] + ([model] if local_model else []))
    errors = shared_path_errors(run_dir, model, missing)
    if errors:
        raise JobValidationError("cluster", errors)


def _check_resources(job: Job) -> None:
    from cluster.job import cross_field_errors

    resources = runtime.cluster_resources()
    errors = cross_field_errors(job, resources)
    if errors:
        raise JobValidationError("cluster", errors)
