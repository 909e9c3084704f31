"""Periodic evaluation beside training: the evaluation sets answered on a generator while the loop goes on (and
`stableasync evaluate`: the same sets answered by a saved model, at the end of this module).

The driver sends a publish's weight load to every generator before anything else it sends, and a generator
runs its calls in the order they were sent; so an evaluation sent right after the publish of step N is
answered with exactly step N's policy even though the loop does not wait for it. Each set's result is logged as
its own row of `metrics.jsonl` (and W&B) at `train/step` N, holding only `eval/*` metrics (`eval/NAME/*` for a
named set), whenever it arrives.
One evaluation runs at a time: the next one, and the end of the run, wait for the one in flight; the step row
says how long (`time/eval_wait_s`), so an evaluation slower than its interval shows.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from actors.generator import GeneratedGroup, GenerationRequest
from algorithms.errors import StableAsyncError
from cluster.job import EvaluationSet, Job, sandbox_limits
from cluster.telemetry.metrics import MetricSink
from tasks.base import final_answer
from tasks.environment import score_responses
from tasks.scoring import ScorePool, ScoreResult

log = logging.getLogger("stableasync")


@dataclass
class RunningEvaluation:
    """One set of an evaluation in flight: the generator answering it, the policy version it evaluates, when it
    was sent, and which set (None: the unnamed one)."""

    index: int
    step: int
    sent: float
    set_name: str | None = None


class Evaluator:
    """Sends the evaluation sets to a generator, and scores and logs each set's answers when they come back."""

    def __init__(self, sets: Sequence[EvaluationSet], job: Job, scorer: ScorePool, sink: MetricSink) -> None:
        """`scorer` is the job's verifier pool: it scores the sets of the job's task; a set read in another task's
        format gets a pool of its own (`set_scorers`), closed by `close` or when the evaluator is collected."""
        self.sets = {evaluation_set.name: evaluation_set for evaluation_set in sets}
        self.requests = evaluation_requests(sets, job.seed)
        self.scorers, owned = set_scorers(sets, job, scorer)
        self.close = weakref.finalize(self, close_pools, owned)
        self.sink = sink
        self.running: dict[ray.ObjectRef, RunningEvaluation] = {}
        self.warned_slow = False  # the first wait is logged; the step rows show every one

    def start(self, generators: Mapping[int, Any], busy_in_send_order: Iterable[int], step: int) -> float:
        """Evaluate step `step`'s policy on one of `generators` (index -> actor, as `evaluation_generator` picks):
        one call per set, in the sets' order; call it right after that step's publish. When an elastic job has no
        generator left, the evaluation is skipped with an alert.

        Returns the seconds the loop waited first for the evaluation before it (0 when none was running).
        """
        index = evaluation_generator(generators, busy_in_send_order)
        if index is None:
            self.sink.alert(
                "evaluation skipped",
                f"step {step}: no generator is left to answer it (every one left "
                "the elastic job); the next one is at its step",
            )
            return 0.0
        earlier = self.steps_running()
        waited_s = self.wait()
        if earlier and not self.warned_slow:
            self.warned_slow = True
            log.warning(
                "the evaluation of step %d was still running when step %d's was due: the loop waited %.2f s "
                "for it (time/eval_wait_s in each step's row). Raise eval.every_steps or lower "
                "eval.num_problems to keep evaluation off training's path",
                earlier[0],
                step,
                waited_s,
            )
        sent = time.perf_counter()
        for name, evaluation_set in self.sets.items():
            ref = generators[index].generate.remote(
                self.requests[name], evaluation_set.samples_per_problem, evaluation_set.temperature
            )
            self.running[ref] = RunningEvaluation(index, step, sent, name)
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
        return list(dict.fromkeys(evaluation.step for evaluation in self.running.values()))

    def abandon(self, why: str) -> None:
        """Stop waiting for the evaluations in flight (the run is stopping); the log says which."""
        for step in self.steps_running():
            log.info("evaluation of step %d not waited for: %s", step, why)
        self.running.clear()

    def finish(self, ref: ray.ObjectRef) -> None:
        """Take one set's answers; a generator that died meanwhile costs this evaluation only, with an alert."""
        evaluation = self.running.pop(ref)
        try:
            groups = ray.get(ref)
        except RayActorError as error:
            self.sink.alert(
                "evaluation skipped",
                f"step {evaluation.step}{_of_set(evaluation.set_name)}: generator "
                f"{evaluation.index} died during it ({type(error).__name__}); the next one is at its step",
            )
            return
        self.record(evaluation, groups)

    def record(self, evaluation: RunningEvaluation, groups: list[GeneratedGroup]) -> None:
        """Score one set's answers and log them as their own row. Answers with any token from other weights than
        the step's (a generator restarted before it loaded them, or a streaming one that loaded the next step's
        mid-answer) are not its evaluation: skipped, with an alert."""
        where = _of_set(evaluation.set_name)
        versions = sorted({version for group in groups for version in (group.version_start, group.version_end)})
        if versions != [evaluation.step]:  # a streaming generator can load the next weights mid-answer
            self.sink.alert(
                "evaluation skipped",
                f"step {evaluation.step}{where}: generator {evaluation.index} "
                f"answered with the weights of step{'s' if len(versions) > 1 else ''} "
                f"{', '.join(map(str, versions))}",
            )
            return
        evaluation_set = self.sets[evaluation.set_name]
        metrics = answer_metrics(
            groups, score_answers(self.scorers[evaluation.set_name], evaluation_set, groups), evaluation_set.pass_at
        )
        log.info("evaluation at step %d%s: %s", evaluation.step, where, summary_line(metrics))
        metrics.update(
            {"eval/policy_version": groups[0].version_start, "eval/seconds": time.perf_counter() - evaluation.sent}
        )
        self.sink.log_evaluation(evaluation.step, {evaluation_set.key(key): value for key, value in metrics.items()})


def _of_set(name: str | None) -> str:
    """How log lines and alerts name a set: nothing for the unnamed one, as before there were named sets."""
    return "" if name is None else f" (set {name})"


def evaluation_requests(sets: Sequence[EvaluationSet], seed: int) -> dict[str | None, list[GenerationRequest]]:
    """Each set's generate requests: group ids below 0 (never a training group's) and distinct over the sets,
    and seeds that repeat at every evaluation, so the same policy samples the same answers."""
    requests, first = {}, 0
    for evaluation_set in sets:
        requests[evaluation_set.name] = [
            GenerationRequest(-1 - first - i, problem.problem_id, messages, seed + i, problem)
            for i, (problem, messages) in enumerate(evaluation_set.problems)
        ]
        first += len(evaluation_set.problems)
    return requests


def verifier_pool(job: Job, task_name: str, task_config: Any) -> ScorePool:
    """Verifier subprocesses of a task, as the job's `scoring` and `sandbox` sections set them."""
    scoring = job.scoring
    return ScorePool(
        task_name,
        task_config,
        max_workers=scoring.workers,
        timeout_s=scoring.timeout_s,
        memory_limit_mb=scoring.memory_limit_mb,
        startup_timeout_s=scoring.startup_timeout_s,
        limits=sandbox_limits(job),
    )


def set_scorers(
    sets: Sequence[EvaluationSet], job: Job, scorer: ScorePool
) -> tuple[dict[str | None, ScorePool], list[ScorePool]]:
    """The pool that scores each set: `scorer` (the job's verifiers) for the sets of the job's task, one new pool
    per other task format (a gsm8k set of an arithmetic job); and the new pools, which the caller closes."""
    own: dict[str, ScorePool] = {}
    try:
        for evaluation_set in sets:
            if evaluation_set.task_name != job.task.name and evaluation_set.task_name not in own:
                own[evaluation_set.task_name] = verifier_pool(job, evaluation_set.task_name, evaluation_set.task_config)
    except BaseException:  # a worker that cannot start: the ones started are closed
        close_pools(list(own.values()))
        raise
    pools = {evaluation_set.name: own.get(evaluation_set.task_name, scorer) for evaluation_set in sets}
    return pools, list(own.values())


def close_pools(pools: list[ScorePool]) -> None:
    """Stop the verifier subprocesses of `pools` (an evaluator's own, which the loop does not know of)."""
    for pool in pools:
        pool.close()


def score_answers(
    scorer: ScorePool, evaluation_set: EvaluationSet, groups: Sequence[GeneratedGroup]
) -> list[ScoreResult]:
    """Each answer's score, in the groups' order (group i holds the answers to the set's problem i)."""
    problems = [
        problem for (problem, _), group in zip(evaluation_set.problems, groups, strict=True) for _ in group.completions
    ]
    return score_responses(scorer, problems, [answer for group in groups for answer in group.completions])


PASS_AT_KEY = "eval/pass_at_K"  # with K each k of eval.pass_at


def answer_metrics(
    groups: Sequence[GeneratedGroup], scores: Sequence[ScoreResult], pass_at: Sequence[int] = ()
) -> dict[str, float]:
    """One set's eval/* metrics from its answers (group i: the n answers to problem i) and their scores. An
    answer is correct when it has the full reward. eval/solved is avg@n, the mean over all answers (each
    counts alike); eval/pass_at_k the share of problems with at least one correct answer among their n;
    eval/pass_at_K for each K of `pass_at` the unbiased estimate of pass@K from the n answers; eval/maj_at_k
    the share of problems whose most frequent final answer is correct."""
    rewards = [score.reward for score in scores]
    correct = [reward >= 1.0 for reward in rewards]
    bounds = list(itertools.accumulate((len(group.completions) for group in groups), initial=0))
    per_problem = [(correct[start:end], group.completions) for group, start, end in zip(groups, bounds, bounds[1:])]
    metrics = {
        "eval/reward_mean": statistics.fmean(rewards),
        "eval/solved": statistics.fmean(correct),
        "eval/pass_at_k": statistics.fmean(any(marks) for marks, _ in per_problem),
        "eval/maj_at_k": statistics.fmean(
            majority_correct(marks, [answer["text"] for answer in answers]) for marks, answers in per_problem
        ),
        "eval/response_len": statistics.fmean(
            len(answer["completion_ids"]) for group in groups for answer in group.completions
        ),
        "eval/score_errors": sum(score.error is not None for score in scores),
        "eval/problems": len(groups),
        "eval/answers": len(rewards),
    }
    for k in pass_at:
        metrics[PASS_AT_KEY.replace("_K", f"_{k}")] = statistics.fmean(
            unbiased_pass_at(len(marks), sum(marks), k) for marks, _ in per_problem
        )
    return metrics


def unbiased_pass_at(answers: int, correct: int, k: int) -> float:
    """The chance that k of a problem's `answers` drawn without replacement hold a correct one, `correct` of
    them being so: 1 - C(n - c, k) / C(n, k) (Chen et al. 2021), pass@k without the bias of using exactly k."""
    return 1.0 - math.comb(answers - correct, k) / math.comb(answers, k)


def majority_correct(correct: Sequence[bool], texts: Sequence[str]) -> bool:
    """Whether a problem's most frequent final answer (the last <answer></answer>, else the last box; ties to
    the answer given first) is a correct one; answers without a final answer do not vote."""
    votes: dict[str, list[bool]] = {}
    for mark, text in zip(correct, texts, strict=True):
        answer = final_answer(text)
        if answer is not None:
            votes.setdefault(" ".join(answer.split()), []).append(mark)
    if not votes:
        return False
    most_votes = max(votes.values(), key=len)
    return any(most_votes)


def summary_line(metrics: dict[str, float]) -> str:
    """A set's result in words, from its `answer_metrics`."""
    problems = int(metrics["eval/problems"])
    return (
        f"{round(metrics['eval/pass_at_k'] * problems)} of {problems} problems solved, "
        f"{100 * metrics['eval/solved']:.1f}% of {int(metrics['eval/answers'])} answers correct, "
        f"mean reward {metrics['eval/reward_mean']:.3f}"
    )


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
            log.warning(
                "the evaluation of step %d was in flight at the checkpoint of step %d and is lost: the "
                "weights of step %d are not kept",
                step,
                restored_step,
                step,
            )
    if restored_step in in_flight:
        log.info("evaluating step %d again: its evaluation was in flight at the checkpoint", restored_step)
        return True
    return False


# ---- `stableasync evaluate`: the sets answered by a saved model, without training or Ray ----


class SavedModelError(StableAsyncError, ValueError):
    """`stableasync evaluate` was given no model folder: the message says what to give instead."""


def saved_model_folder(model_or_run: Path) -> Path:
    """The Hugging Face model folder `stableasync evaluate` loads: MODEL_OR_RUN itself, a run directory's
    `model/` (the policy a finished run saved), or a hub id's folder in the Hugging Face cache."""
    from learner.models import HUB_ID, ModelPathError, hub_model_folder

    if (model_or_run / "config.json").is_file():
        return model_or_run
    if not model_or_run.exists() and HUB_ID.match(str(model_or_run)):
        try:
            return Path(hub_model_folder(str(model_or_run), "MODEL_OR_RUN"))
        except ModelPathError as error:
            raise SavedModelError(str(error)) from error
    if (model_or_run / "job.yaml").is_file():  # a run directory
        model = model_or_run / "model"
        if (model / "config.json").is_file():
            return model
        raise SavedModelError(
            f"{model_or_run} is a run directory without a saved model ({model}: the run did not "
            "finish, or ran with checkpoint.save_model false); write one from its newest "
            f"checkpoint with `stableasync export {model_or_run}` and evaluate the folder it prints"
        )
    raise SavedModelError(
        f"{model_or_run} is neither a Hugging Face model folder (no config.json) nor a run directory (no job.yaml)"
    )


@dataclass(frozen=True)
class SavedModelEvaluation:
    """What `stableasync evaluate` prints and writes: each set's results by its label, and every answer (the set,
    problem, gold answer, response, reward and score error) for a person to read."""

    results: dict[str, dict[str, Any]]
    answers: list[dict[str, Any]]


def evaluate_saved_model(job: Job, model_path: Path, sets: Sequence[EvaluationSet]) -> SavedModelEvaluation:
    """Every set answered by the model at `model_path` on one generator in this process (the job's generator
    settings; no Ray), scored by the job's verifiers."""
    from actors.generator import Generator
    from cluster.job import section_config
    from cluster.run.specs import generator_spec
    from tasks.config import TASK_CONFIGS

    spec = dataclasses.replace(generator_spec(job, str(model_path)), lora=None, streaming=False)  # a merged model
    generator = Generator(spec)
    verifiers = verifier_pool(job, job.task.name, section_config(job.task, TASK_CONFIGS))
    results, answers = {}, []
    try:
        scorers, owned = set_scorers(sets, job, verifiers)
        requests = evaluation_requests(sets, job.seed)
        try:
            for evaluation_set in sets:
                started = time.perf_counter()
                groups = generator.generate(
                    requests[evaluation_set.name], evaluation_set.samples_per_problem, evaluation_set.temperature
                )
                scores = score_answers(scorers[evaluation_set.name], evaluation_set, groups)
                metrics = answer_metrics(groups, scores, evaluation_set.pass_at)
                log.info("set %s: %s", evaluation_set.label, summary_line(metrics))
                results[evaluation_set.label] = {
                    "logged_as": evaluation_set.key("eval/*"),
                    "task": evaluation_set.task_name,
                    "samples_per_problem": evaluation_set.samples_per_problem,
                    "temperature": evaluation_set.temperature,
                    **{key.removeprefix("eval/"): value for key, value in metrics.items()},
                    "seconds": time.perf_counter() - started,
                }
                answers += answer_rows(evaluation_set, groups, scores)
        finally:
            close_pools(owned)
    finally:
        verifiers.close()
    return SavedModelEvaluation(results, answers)


def answer_rows(
    evaluation_set: EvaluationSet, groups: Sequence[GeneratedGroup], scores: Sequence[ScoreResult]
) -> list[dict[str, Any]]:
    """One row per answer, in the groups' order (verl's validation generations, TRL's logged completions)."""
    answered = [
        (problem, completion)
        for (problem, _), group in zip(evaluation_set.problems, groups, strict=True)
        for completion in group.completions
    ]
    return [
        {
            "set": evaluation_set.label,
            "problem_id": problem.problem_id,
            "question": problem.question,
            "answer": problem.answer,
            "response": completion["text"],
            "finish_reason": completion["finish_reason"],
            "reward": score.reward,
            "score_error": score.error,
        }
        for (problem, completion), score in zip(answered, scores, strict=True)
    ]


RESULT_COLUMNS = (
    ("solved (avg@k)", "solved", "{:.3f}"),
    ("pass@k", "pass_at_k", "{:.3f}"),
    ("maj@k", "maj_at_k", "{:.3f}"),
    ("reward", "reward_mean", "{:.3f}"),
    ("k", "samples_per_problem", "{}"),
    ("problems", "problems", "{}"),
    ("answers", "answers", "{}"),
    ("score errors", "score_errors", "{}"),
)


def results_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """`evaluate_saved_model`'s results as a text table, one row per set."""
    width = max(len("set"), *(len(name) for name in results))
    lines = [f"{'set':<{width}}" + "".join(f"  {title:>14}" for title, _, _ in RESULT_COLUMNS)]
    for name, result in results.items():
        lines.append(
            f"{name:<{width}}" + "".join(f"  {form.format(result[key]):>14}" for _, key, form in RESULT_COLUMNS)
        )
    return "\n".join(lines)
