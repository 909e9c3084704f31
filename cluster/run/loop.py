"""The asynchronous loop: one turn issues generation, starts a learner step, and handles the next
completion Ray reports.

The loop keeps every generator busy as long as the rollout buffer admits more groups under the lag
bound, starts a learner step whenever a batch of fresh groups is ready, and after each step publishes
the new weights; a generator picks them up before its next request (Ray runs an actor's calls in
order), so it never restarts and never waits for the learner unless the lag bound says so.

What to issue and take is decided by the schedule (`cluster/run/schedule.py`, no Ray); generator faults
and elastic membership by the pool (`cluster/run/generators.py`); learner faults and halts by
`cluster/run/faults.py`. This module ties them to Ray, the scorer, the metrics and the checkpoints.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.buffer import Ledger, RolloutBuffer, ScoredGroup
from actors.generator import GeneratedGroup, GenerationRequest
from algorithms.rewards import overlong_penalty
from cluster.job import EvaluationSet, Job, section_config
from cluster.run import learner_group, weight_sync
from cluster.run.checkpoints import CheckpointFailed, readable_checkpoints, write_checkpoint
from cluster.run.evaluation import Evaluator, evaluate_again_on_resume, verifier_pool
from cluster.run.faults import NumericalFailure, ScoreFailureStreak, SkipStreak, learners_may_crash, streak_halt
from cluster.run.generators import SCALE_CHECK_S, GeneratorPool
from cluster.run.rewards import training_scorer
from cluster.run.schedule import Call, Schedule, SchedulerStuck
from cluster.run.specs import rollout_buffer
from cluster.run.state import DriverState, InFlight
from cluster.run.step_rows import GenerationTotals, ScoredSinceStep, lag_metrics, version_mix
from cluster.run.stopping import JobStopped, StopRequest
from cluster.telemetry.metrics import MetricSink
from cluster.telemetry.samples import rollout_samples
from learner.batch import TrainBatch, rank_shards, rank_share_sizes
from tasks.base import Problem, Task
from tasks.config import TASK_CONFIGS
from tasks.environment import score_responses
from tasks.records import ScoredCompletion
from tasks.scoring import ScorePool, ScoreResult


def reward_workers(job: Job) -> ScorePool:
    """The verifier subprocesses of the job's task, as its `scoring` section sets them."""
    return verifier_pool(job, job.task.name, section_config(job.task, TASK_CONFIGS))


class AsyncLoop:
    """Generators, scorer, buffer and learner, driven by completions (`ray.wait`)."""

    # long: the loop's whole state, a field a line, so no field appears later
    def __init__(
        self,
        job: Job,
        task: Task,
        evaluation: list[EvaluationSet],
        learners: learner_group.LearnerGroup,
        generators: dict[int, Any],
        ledger: Ledger,
        sink: MetricSink,
        run_dir: Path,
        start_generator: Callable[[int], Any],
        generator_nodes: dict[str, str],
        stop: StopRequest,
    ) -> None:
        self.job, self.task, self.learners, self.sink = job, task, learners, sink
        self.stop = stop
        self.run_dir = run_dir
        self.generators = dict(generators)  # index -> actor; elastic jobs add and remove members
        sync, dtype = job.async_.weight_sync, job.model.dtype_on(gpu=job.generator.gpus_per_generator > 0)
        self.publisher = (
            weight_sync.ObjectStorePublisher(learners, self.generators, dtype, wait_for_loads=job.generator.streaming)
            if sync == "object_store"
            else weight_sync.CollectivePublisher(
                learners, self.generators, sync, dtype, job.generator.tensor_parallel_size
            )
        )
        self.schedule: Schedule[GenerationRequest, ray.ObjectRef] = Schedule(
            rollout_buffer(job, ledger),
            job.generator.prompts_per_request,
            self._new_request,
            self._send,
            calls_per_generator=job.generator.requests_in_flight if job.generator.streaming else 1,
        )
        for index in generators:
            self.schedule.join(index, 0)
        self.pool = GeneratorPool(
            self.generators,
            self.schedule,
            start_generator,
            self.publisher.restore,
            generator_nodes,
            job.cluster.generator_resource,
            job.generator.max_generators,
            job.generator.max_restarts,
        )
        self.scored = ScoredSinceStep()
        self.score_failures = ScoreFailureStreak.of(job)
        self.totals = GenerationTotals()
        self.problems: Iterator[Problem] = task.problems("train", job.seed)
        self.problem_of: dict[int, Problem] = {}
        self.problems_drawn = 0
        self.resumed_requests: list[GenerationRequest] = []
        verifiers = reward_workers(job)  # the evaluation's scorer; training's too, unless scoring.rewards is set
        try:
            self.scorer = training_scorer(job, task, verifiers)
        except BaseException:  # a reward model actor that cannot start
            verifiers.close()
            raise
        self.rng = random.Random(job.seed)
        self.learner_refs: list[ray.ObjectRef] = []
        self.step_started = 0.0
        self.pad_id = 0
        self.rewards: list[float] = []
        self.skips = SkipStreak(job.learner.max_skipped_steps_in_a_row)
        self.checkpoint_failures = 0
        self.evaluator = Evaluator(evaluation, job, verifiers, sink)
        self.evaluations_to_redo: list[int] = []  # policy versions a checkpoint was still evaluating
        self.resumed = False  # restored from a checkpoint (set by restore)

    @property
    def version(self) -> int:
        """Learner optimizer steps taken."""
        return self.schedule.version

    @property
    def buffer(self) -> RolloutBuffer:
        return self.schedule.buffer

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
                    self.pool.scale()
                    self.schedule.issue()
                    self._start_learner_step()
                self._handle(self._wait_one())
                self._check_streaks()
            self.evaluator.wait()  # the last step's evaluation
        finally:
            self.scorer.close()
            self.evaluator.close()  # the pools of sets in another task's format
        self._end_unfinished_groups("run finished", wait_for_generation=True)
        return self.rewards

    def _stopped(self) -> JobStopped:
        """Checkpoint the run where it stands, which holds the groups in flight and buffered; the ledger
        ends them as dropped (a resume cuts it back to the checkpoint and picks them up again)."""
        checkpoint = self._checkpoint()
        self.evaluator.abandon(
            f"the run stopped (a resume from {checkpoint.name} evaluates again what it was evaluating)"
        )
        self._end_unfinished_groups(
            f"run stopped by {self.stop.signal_name} at step {self.version} (resumable)", wait_for_generation=False
        )
        signal_name = self.stop.signal_name
        assert signal_name is not None  # the loop stops here only once a stop was requested
        return JobStopped(signal_name, self.version, checkpoint, self.run_dir)

    def _end_unfinished_groups(self, why: str, wait_for_generation: bool) -> None:
        """Record in the ledger that every group still generating, orphaned or buffered ends untrained."""
        for ref in self.schedule.end_unfinished(why):
            if wait_for_generation:  # let it finish before its generator is killed
                with contextlib.suppress(RayActorError):
                    ray.get(ref)

    # ---- one turn of the loop ------------------------------------------------------------------

    def _send(self, call: Call[GenerationRequest]) -> ray.ObjectRef:
        return self.generators[call.index].generate.remote(call.requests)

    def _new_request(self, group_id: int, generator_index: int) -> GenerationRequest:
        problem = next(self.problems)
        self.problems_drawn += 1
        self.problem_of[group_id] = problem
        return GenerationRequest(
            group_id, problem.problem_id, self.task.messages(problem), self.rng.getrandbits(31), problem
        )

    def _start_learner_step(self) -> None:
        groups = self.schedule.take_batch()
        if groups is None:
            return
        self.step_started = time.perf_counter()
        self.learner_refs = self.learners.train_step(self._shards(groups))

    def _wait_one(self) -> ray.ObjectRef | None:
        """The next finished call; None when an elastic job should look at the cluster again first.

        A stopping run waits for its learner step only: what is still generating goes out again on resume.
        """
        if self.stop.requested:
            return ray.wait(self.learner_refs, num_returns=1)[0][0]
        # every rank's ref: a rank that raises wakes the loop even while the others wait in a collective
        pending = (
            list(self.schedule.calls) + self.learner_refs + list(self.pool.starting) + list(self.evaluator.running)
        )
        if not pending and not self.pool.elastic:
            raise SchedulerStuck("nothing to wait for: the buffer admits no generation and no batch is ready")
        if not pending:
            self.pool.wait_alone()
            return None
        self.pool.alone_since = None
        ready, _ = ray.wait(pending, num_returns=1, timeout=SCALE_CHECK_S if self.pool.elastic else None)
        return ready[0] if ready else None

    def _handle(self, ref: ray.ObjectRef | None) -> None:
        if ref is None:
            return
        if ref in self.schedule.calls:
            self._handle_generation(ref)
        elif ref in self.pool.starting:
            self.pool.join(ref)
        elif ref in self.evaluator.running:
            self.evaluator.finish(ref)
        else:
            self._handle_step()

    def _handle_generation(self, ref: ray.ObjectRef) -> None:
        call = self.schedule.finished(ref)
        try:
            groups: list[GeneratedGroup] = ray.get(ref)
        except RayActorError as error:
            self.pool.failed(call, error)
            return
        if self.pool.sampled_before_restart(call, groups):
            return
        self.totals.add(groups)
        requests = {request.group_id: request for request in call.requests}
        self._score_and_buffer(groups, [requests[group.group_id] for group in groups])

    def _handle_step(self) -> None:
        with learners_may_crash(f"during step {self.version + 1}", self.run_dir):
            metrics = self.learners.results(self.learner_refs, "train_step")[0]
        self.learner_refs = []
        skipped = metrics.get("stability/skipped_step", 0.0) > 0
        training = self.schedule.training or []
        mix = version_mix(training, self.version) if self.job.generator.streaming else {}
        lags = self.schedule.step_done(  # a skipped step did not move the weights: the ledger says so
            f"step {self.version + 1} skipped: non-finite loss or importance weights" if skipped else None
        )
        sync_s = self._sync_weights()
        step_s = time.perf_counter() - self.step_started
        eval_wait_s = self._start_evaluation() if self._due(self.job.eval.every_steps) else 0.0
        self._log_step({**metrics, **mix}, lags, sync_s, step_s, eval_wait_s)
        if self._due(self.job.logging.samples.every_steps):
            self._log_samples(training)
        if self._due(self.job.checkpoint.every_steps):
            self._periodic_checkpoint()
        self._check_skipped(skipped)

    def _log_samples(self, training: list[ScoredGroup]) -> None:
        """A few of the step's groups, from rank 0's shard (the first groups), with the learner's log-ratios."""
        settings = self.job.logging.samples
        rank0_groups = training[: rank_share_sizes(len(training), self.job.learner.num_ranks)[0]]
        samples = rollout_samples(
            self.version,
            self.version - 1,
            rank0_groups[: settings.groups],
            self.learners.sequence_log_ratios(),
            settings.max_chars,
        )
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
        busy_in_send_order = [call.index for call in self.schedule.calls.values()]
        return self.evaluator.start(self.generators, busy_in_send_order, self.version)

    def _check_skipped(self, skipped: bool) -> None:
        """Alert on every skipped step; stop with a checkpoint after too many in a row."""
        stop = self.skips.record(skipped)
        if skipped:
            self.sink.alert(
                "learner step skipped",
                f"step {self.version}: non-finite loss or importance weights on a "
                f"learner rank; weights unchanged ({self.skips.count} in a row)",
            )
        if stop:
            path = self._checkpoint()
            raise NumericalFailure(
                f"{self.skips.count} steps in a row had non-finite loss or importance weights "
                f"(learner.max_skipped_steps_in_a_row = {self.skips.limit}); checkpoint at {path}. Fix the cause "
                f"(learning rate, data, stabilizer), then: stableasync train --resume {self.run_dir}"
            )

    def _check_streaks(self) -> None:
        """Stop with a checkpoint once a streak says no step can fill (`faults.streak_halt`: uniform rewards, or a
        reward that fails on every response); only between learner steps, so the checkpoint holds every group
        still to train."""
        halt = None if self.learner_refs else streak_halt(self.buffer, self.score_failures, self.job)
        if halt is None:
            return
        error, why, fix = halt
        path = self._checkpoint()
        self._end_unfinished_groups(f"run halted at step {self.version} (resumable)", wait_for_generation=False)
        raise error(
            f"{why}; checkpoint at {path}. {fix} in {self.run_dir / 'job.yaml'}, then: "
            f"stableasync train --resume {self.run_dir}"
        )

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
            self.sink.alert(
                "checkpoint failed",
                f"{failure}. Training goes on; the newest usable checkpoint is "
                f"{newest} (failed so far: {self.checkpoint_failures})",
            )

    def _checkpoint(self) -> Path:
        with learners_may_crash(f"while checkpointing step {self.version}", self.run_dir):
            return write_checkpoint(
                self.run_dir, self.version, self.job.checkpoint.keep, self.learners.save_checkpoint, self._state()
            )

    def _state(self) -> DriverState:
        return DriverState(
            version=self.version,
            next_group_id=self.schedule.next_group_id,
            problems_drawn=self.problems_drawn,
            rng=DriverState.rng_state(self.rng),
            ready=list(self.buffer.ready),
            in_flight=[InFlight(r, self.problem_of[r.group_id]) for r in self.schedule.in_flight()],
            rewards=self.rewards,
            restarts=sorted((index, m.restarts) for index, m in self.schedule.members.items()),
            evaluating=self.evaluator.steps_running(),
            ledger_lines=self.buffer.ledger.lines,
            metrics_lines=self.sink.lines,
            samples_lines=self.sink.sample_lines,
        )

    def restore(self, state: DriverState) -> None:
        """Continue from a checkpoint's driver state (the learner is restored separately)."""
        self.schedule.version, self.schedule.next_group_id = state.version, state.next_group_id
        for _ in range(state.problems_drawn):
            next(self.problems)
        self.problems_drawn = state.problems_drawn
        state.restore_rng(self.rng)
        self.buffer.ready.extend(state.ready)
        self.rewards = list(state.rewards)
        self.resumed = True
        self.evaluations_to_redo = list(state.evaluating)
        for index, count in state.restarts:
            if index in self.schedule.members:
                self.schedule.members[index].restarts = count
        for item in state.in_flight:
            self.problem_of[item.request.group_id] = item.problem
            self.resumed_requests.append(item.request)

    def _reissue_resumed(self) -> None:
        """Groups that were being generated at the checkpoint go out again, spread over the generators."""
        requests, self.resumed_requests = self.resumed_requests, []
        self.schedule.resume(requests, f"resumed from the checkpoint at step {self.version}")

    # ---- pieces -----------------------------------------------------------------------------------

    def _score_and_buffer(self, groups: list[GeneratedGroup], requests: list[GenerationRequest]) -> None:
        """Score a call's generated groups into the buffer, in one call of the scorer (a reward model scores
        them in batches, instead of the driver waiting on it group by group); a stopping run keeps their
        requests to issue again on resume."""
        problems = [self.problem_of[group.group_id] for group in groups]
        results = (
            None
            if self.stop.requested
            else score_responses(
                self.scorer,
                [problem for problem, group in zip(problems, groups) for _ in group.completions],
                [completion for group in groups for completion in group.completions],
            )
        )
        if results is None or self.stop.requested:  # a stop during scoring may have reached the verifiers too
            self.schedule.orphans += [(request, "generated while the run was stopping") for request in requests]
            return
        bounds = list(itertools.accumulate((len(group.completions) for group in groups), initial=0))
        for group, problem, start, end in zip(groups, problems, bounds, bounds[1:]):
            self._buffer(group, problem, results[start:end])

    def _buffer(self, group: GeneratedGroup, problem: Problem, results: list[ScoreResult]) -> None:
        """One scored group into the buffer, with its rewards' and episodes' statistics."""
        del self.problem_of[group.group_id]
        algorithm = self.job.algorithm
        penalties = [
            overlong_penalty(
                len(c["completion_ids"]),
                self.job.generator.max_new_tokens,
                algorithm.overlong_buffer_tokens,
                algorithm.overlong_penalty,
            )
            for c in group.completions
        ]
        completions = [
            ScoredCompletion(**c, reward=r.reward + penalty, score_error=r.error)
            for c, r, penalty in zip(group.completions, results, penalties)
        ]
        errors = sum(r.error is not None for r in results)
        first = self.score_failures.record([r.error for r in results])
        if first is not None:
            self.sink.alert("reward failed", self.score_failures.first_alert(problem.problem_id))
        components = {  # a component's failed samples have no score of it
            section.name: [r.components[section.name] for r in results if section.name in r.components]
            for section in self.job.scoring.rewards or []
        }
        self.scored.record(completions, penalties, components)
        scored = ScoredGroup(
            group.group_id,
            group.problem_id,
            group.prompt_ids,
            completions,
            group.version_start,
            group.version_end,
            group.generator_index,
            problem.question,
            problem.answer,
        )
        self.scored.record_group_kept(self.buffer.add(scored, errors))

    def _shards(self, groups: list[ScoredGroup]) -> list[TrainBatch]:
        """Each rank's share of the groups as its training batch (`rank_shards`)."""
        return rank_shards([g.samples() for g in groups], self.job.learner.num_ranks, self.pad_id)

    def _sync_weights(self) -> float:
        """Publish the learner's weights; each generator loads them before its next request."""
        start = time.perf_counter()
        with learners_may_crash("while publishing weights", self.run_dir):
            self.publisher.publish(self.version)
        self.schedule.published()
        return time.perf_counter() - start

    def _log_step(
        self, metrics: dict[str, Any], lags: list[int], publish_s: float, step_s: float, eval_wait_s: float
    ) -> None:
        totals = self.totals
        row = {
            **metrics,
            **lag_metrics(lags, self.job.async_.max_lag),
            **totals.metrics(len(self.generators)),
            "async/buffered_groups": len(self.buffer.ready),
            "perf/weight_sync_s": publish_s,
            "fault/generator_restarts": self.schedule.generator_restarts,
            "async/num_generators": len(self.generators),
            "time/step_s": step_s,
            "time/eval_wait_s": eval_wait_s,  # the loop held up by the previous evaluation
        }
        row.update(self.scored.metrics(self.job.algorithm, self.job.scoring, bool(self.job.environment.tools)))
        self.scored = ScoredSinceStep()
        totals.busy_s_since_step = 0.0
        self.rewards.append(metrics.get("rollout/reward_mean", math.nan))
        self.sink.log(self.version, row)
