"""Periodic evaluation beside training: the fixed evaluation set answered on a generator while the loop goes on.

The driver sends a publish's weight load to every generator before anything else it sends, and a generator
runs its calls in the order they were sent; so an evaluation sent right after the publish of step N is
answered with exactly step N's policy even though the loop does not wait for it. Its result is logged as its
own row of `metrics.jsonl` (and W&B) at `train/step` N, holding only `eval/*` metrics, whenever it arrives.
One evaluation runs at a time: the next one, and the end of the run, wait for the one in flight; the step row
says how long (`time/eval_wait_s`), so an evaluation slower than its interval shows.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.generator import GeneratedGroup, GenerationRequest
from cluster.telemetry.metrics import MetricSink
from tasks.base import Problem
from tasks.scoring import ScorePool

log = logging.getLogger("stableasync")


@dataclass
class RunningEvaluation:
    """An evaluation in flight: the generator answering it, the policy version it evaluates, when it was sent."""

    index: int
    step: int
    sent: float


class Evaluator:
    """Sends the fixed evaluation set to a generator, and scores and logs the answers when they come back."""

    def __init__(self, problems: list[tuple[Problem, list[dict[str, str]]]], temperature: float,
                 samples_per_problem: int, seed: int, scorer: ScorePool, sink: MetricSink) -> None:
        self.requests = [GenerationRequest(-1 - i, problem.problem_id, messages, seed + i)
                         for i, (problem, messages) in enumerate(problems)]
        self.problems = [problem for problem, _ in problems]
        self.temperature, self.samples = temperature, samples_per_problem
        self.scorer, self.sink = scorer, sink
        self.running: dict[ray.ObjectRef, RunningEvaluation] = {}
        self.warned_slow = False  # the first wait is logged; the step rows show every one

    def start(self, generators: Mapping[int, Any], busy_in_send_order: Iterable[int], step: int) -> float:
        """Evaluate step `step`'s policy on one of `generators` (index -> actor, as `evaluation_generator` picks);
        call it right after that step's publish. When an elastic job has no generator left, the evaluation is
        skipped with an alert.

        Returns the seconds the loop waited first for the evaluation before it (0 when none was running).
        """
        index = evaluation_generator(generators, busy_in_send_order)
        if index is None:
            self.sink.alert("evaluation skipped", f"step {step}: no generator is left to answer it (every one left "
                            "the elastic job); the next one is at its step")
            return 0.0
        earlier = self.steps_running()
        waited_s = self.wait()
        if earlier and not self.warned_slow:
            self.warned_slow = True
            log.warning("the evaluation of step %d was still running when step %d's was due: the loop waited %.2f s "
                        "for it (time/eval_wait_s in each step's row). Raise eval.every_steps or lower "
                        "eval.num_problems to keep evaluation off training's path", earlier[0], step, waited_s)
        ref = generators[index].generate.remote(self.requests, self.samples, self.temperature)
        self.running[ref] = RunningEvaluation(index, step, time.perf_counter())
        return waited_s

    def wait(self) -> float:
        """Finish the evaluation in flight, if any; the seconds that took."""
        if not self.running:
            return 0.0
        started = time.perf_counter()
        for ref in list(self.running):
            self.finish(ref)
        return time.perf_counter() - started

    def steps_running(self) -> list[int]:
        """The policy versions being evaluated (a checkpoint records them, so a resume can answer again)."""
        return [evaluation.step for evaluation in self.running.values()]

    def abandon(self, why: str) -> None:
        """Stop waiting for the evaluations in flight (the run is stopping); the log says which."""
        for evaluation in self.running.values():
            log.info("evaluation of step %d not waited for: %s", evaluation.step, why)
        self.running.clear()

    def finish(self, ref: ray.ObjectRef) -> None:
        """Take one evaluation's answers; a generator that died meanwhile costs this evaluation only, with an
        alert."""
        evaluation = self.running.pop(ref)
        try:
            groups = ray.get(ref)
        except RayActorError as error:
            self.sink.alert("evaluation skipped", f"step {evaluation.step}: generator {evaluation.index} died "
                            f"during it ({type(error).__name__}); the next one is at its step")
            return
        self.record(evaluation, groups)

    def record(self, evaluation: RunningEvaluation, groups: list[GeneratedGroup]) -> None:
        """Score the answers and log the evaluation's row. Answers from other weights than the step's (a
        generator restarted before it loaded them) are not its evaluation: skipped, with an alert."""
        if groups[0].version_start != evaluation.step:
            self.sink.alert("evaluation skipped", f"step {evaluation.step}: generator {evaluation.index} still had "
                            f"the weights of step {groups[0].version_start}")
            return
        answers = [answer for group in groups for answer in group.completions]
        problems = [problem for problem, group in zip(self.problems, groups) for _ in group.completions]
        scores = self.scorer.score_many(problems, [answer["text"] for answer in answers])
        rewards = [score.reward for score in scores]
        correct = [reward >= 1.0 for reward in rewards]  # the full reward: a correct answer
        bounds = list(itertools.accumulate((len(group.completions) for group in groups), initial=0))
        solved = sum(any(correct[start:end]) for start, end in zip(bounds, bounds[1:]))  # problems
        log.info("evaluation at step %d: %d of %d problems solved, %.1f%% of %d answers correct, mean reward %.3f",
                 evaluation.step, solved, len(groups), 100 * statistics.fmean(correct), len(answers),
                 statistics.fmean(rewards))
        self.sink.log_evaluation(evaluation.step, {
            "eval/reward_mean": statistics.fmean(rewards),
            "eval/solved": statistics.fmean(correct),  # avg@k: each answer counts alike
            "eval/pass_at_k": solved / len(groups),
            "eval/response_len": statistics.fmean(len(answer["completion_ids"]) for answer in answers),
            "eval/score_errors": sum(score.error is not None for score in scores),
            "eval/policy_version": groups[0].version_start,
            "eval/problems": len(groups),
            "eval/seconds": time.perf_counter() - evaluation.sent,
        })


def evaluation_generator(generators: Iterable[int], busy_in_send_order: Iterable[int]) -> int | None:
    """Which generator answers an evaluation: the lowest-index idle one, whose answers come back soonest; when
    all are generating, the one whose call was sent first (it is likely to finish first). None when an elastic
    job has no generator left."""
    members = set(generators)
    busy = [index for index in busy_in_send_order if index in members]
    idle = sorted(members - set(busy))
    return idle[0] if idle else (busy[0] if busy else None)


def evaluate_again_on_resume(in_flight: list[int], restored_step: int) -> bool:
    """On resume: whether to evaluate the restored step again, because the checkpoint was still evaluating it
    (its row fell after the metrics cut). An evaluation of an earlier step is lost, with a warning: the
    checkpoint keeps only its own step's weights."""
    for step in in_flight:
        if step != restored_step:
            log.warning("the evaluation of step %d was in flight at the checkpoint of step %d and is lost: the "
                        "weights of step %d are not kept", step, restored_step, step)
    if restored_step in in_flight:
        log.info("evaluating step %d again: its evaluation was in flight at the checkpoint", restored_step)
        return True
    return False
