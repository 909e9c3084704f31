"""One metric sink: JSONL in the run directory always, W&B when it works, a progress line for people.

Metric logging is never fatal: a W&B failure is logged once and training goes on with the JSONL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal

from cluster.telemetry.alerts import AlertThresholds, StabilityAlerts
from cluster.telemetry.run_files import EVAL_PREFIX, STEP_KEY, WALL_KEY
from cluster.telemetry.samples import COLUMNS, RolloutSample, as_rows

SAMPLES_FILE = "samples.jsonl"
SAMPLES_TABLE = "samples/rollouts"

log = logging.getLogger("stableasync")

# Every key the project logs, with what it means. The W&B workspace (deploy/wandb/workspace.yaml) may
# only plot these, and tests/unit/cluster/test_metrics.py checks this table against the keys in the source.
KNOWN_METRICS: dict[str, str] = {
    STEP_KEY: "policy version after this step (optimizer steps); the SFT warm-up's N steps are -N..-1",
    SAMPLES_TABLE: "a W&B table of a few trained responses every logging.samples.every_steps steps: question, "
    "reference answer, completion, reward, score error, finish reason, lag and learner/behaviour log-ratio "
    "(also RUN_DIR/samples.jsonl)",
    "rollout/reward_mean": "mean reward of the step's trained samples",
    "rollout/response_len": "mean completion length of the step's trained samples (tokens)",
    "rollout/zero_std_share": "share of the step's trained responses whose prompt group scored every response the "
    "same: no advantage to learn from (TRL's frac_reward_zero_std); an alert when most are so for a while",
    "rollout/uniform_groups_dropped": "prompt groups dropped since the previous step because every response "
    "scored the same (algorithm.drop_uniform_groups)",
    "rollout/scored_reward_mean": "mean reward of every response scored since the previous step, the dropped "
    "uniform groups included (logged with algorithm.drop_uniform_groups, where rollout/reward_mean leaves them out)",
    "rollout/truncated_share": "share of the responses scored since the previous step that the generator cut off "
    "at generator.max_new_tokens (trained or not)",
    "rollout/score_errors": "responses scored since the previous step whose verifier or reward function failed "
    "(raised, hung, returned no finite number within 1e6): left out of training, each reason in the ledger",
    "rollout/turns_mean": "environment.tools: policy turns per episode scored since the previous step",
    "rollout/tool_calls_mean": "environment.tools: tool calls run per episode",
    "rollout/tool_errors_mean": "environment.tools: calls per episode answered with an error the model reads (a "
    "malformed call, an unknown tool, wrong arguments)",
    "rollout/failed_episode_share": "environment.tools: share of episodes a tool failed (raised, hung, printed too "
    "much): not scored, reward 0, the reason in the ledger",
    "rollout/tool_token_share": "environment.tools: share of the episodes' tokens that are tool results (context, "
    "off the loss)",
    "rollout/reward_task_mean": "scoring.rewards: mean score of the task's verifier component over the responses "
    "scored since the previous step whose verifier succeeded (before its weight)",
    "rollout/reward_format_mean": "scoring.rewards: mean of the format component (1.0 with an <answer></answer>) "
    "over the responses scored since the previous step (before its weight)",
    "rollout/reward_reward_model_mean": "scoring.rewards: mean reward-model score over the responses scored since "
    "the previous step that it scored (before its weight; its failures fail the sample)",
    "rollout/overlong_penalty_mean": "mean overlong penalty (algorithm.overlong_buffer_tokens) of the responses "
    "scored since the previous step; the rewards trained on include it",
    "stability/ess_ratio": "effective sample size / samples of the sequence importance weights (1: on-policy)",
    "stability/ess_ratio_clipped": "ESS ratio of the capped sequence weights (VCPO)",
    "stability/lr_scale": "learning-rate multiplier of this step (VCPO's ESS rule; 0 on a skipped step)",
    "stability/kl_k1": "k1 estimate of KL(behaviour || learner) per token",
    "stability/kl_k3": "k3 estimate of KL(behaviour || learner) per token (non-negative, low variance)",
    "stability/chi2_token": "chi-square divergence of the token importance ratios",
    "stability/chi2_seq": "chi-square divergence of the sequence importance weights",
    "stability/m2": "mean squared token log-ratio (M2PO's second moment)",
    "stability/entropy": "mean entropy of the learner's next-token distribution on loss tokens (nats); a collapse "
    "to 0 means the policy stopped exploring",
    "stability/m2_after": "M2PO's second moment after masking or clipping",
    "stability/clip_frac": "fraction of loss tokens whose weight was clipped",
    "stability/clip_low": "lower clip bound of the ratio this step (BAPO, M2PO adaptive clip)",
    "stability/clip_high": "upper clip bound of the ratio this step (BAPO, M2PO adaptive clip)",
    "stability/positive_share": "positive-advantage tokens' share of the clipped objective (BAPO)",
    "stability/mask_frac": "fraction of loss tokens masked out by the stabilizer",
    "stability/seq_mask_frac": "fraction of sequences with at least one masked token",
    "stability/is_weight_mean": "mean token importance weight after the stabilizer",
    "stability/is_weight_max": "largest token importance weight after the stabilizer",
    "stability/skipped_step": "1 if the step was skipped for non-finite loss or weights, else 0",
    "stability/proximal_clip_frac": "algorithm.proximal recompute: share of loss tokens over the step's updates whose "
    "ratio to the proximal policy left the trust region (no gradient)",
    "stability/skipped_updates": "algorithm.proximal recompute: updates of the step left out after a non-finite loss",
    "stability/kl_ref_mean": "algorithm.kl: the estimator's KL of the learner (at the step's start) to the frozen "
    "starting policy, per loss token; 0 at the first step",
    "stability/kl_ref_coef": "algorithm.kl: the KL coefficient this step used (moves with an adaptive target)",
    "rollout/kl_ref_penalty_mean": "algorithm.kl in: reward: mean reward each response lost to its KL to the "
    "reference (coef x summed token KL from its behaviour log-probs)",
    "optim/updates": "optimizer updates the step applied (learner.mini_batches x learner.epochs, fewer after a "
    "non-finite loss)",
    "optim/loss": "policy loss of the step",
    "optim/grad_norm": "global gradient norm before clipping (NaN on a skipped step; the largest update's with "
    "algorithm.proximal recompute)",
    "optim/lr": "learning rate of this step: learner.learning_rate x the schedule (warm-up, decay) x "
    "stability/lr_scale (0 on a skipped step)",
    "opob/baseline_mean": "mean of VCPO's off-policy optimal baseline",
    "opob/group_mean_baseline_mean": "mean of the plain group-mean baseline, for comparison",
    "opob/baseline_shift_abs": "mean |optimal baseline - group-mean baseline|",
    "opob/sample_grad_norm_mean": "mean per-sample gradient norm (feeds the optimal baseline)",
    "opob/sample_grad_norm_median": "median per-sample gradient norm",
    "opob/sample_grad_norm_max": "largest per-sample gradient norm",
    "opob/bookkeeping_share": "share of the step's micro-batches whose update book-keeping formed from kept per-sample "
    "gradients (opob_impl auto: those that fit bookkeeping_budget_mb); the rest took the ghost norms backward",
    "opob/folded_share": "share of the step's micro-batches whose book-keeping folded the linear weights' per-sample "
    "gradients into two sums per prompt group as they were formed, instead of keeping them",
    "opob/carried_groups": "prompt groups split across micro-batches and trained in one pass with the score buffer "
    "(mean over ranks)",
    "opob/fallback_to_loop": "1 if per-sample norms fell back to the slow per-sample loop",
    "async/lag": "histogram of trained samples' lag (bin k counts samples k versions old)",
    "async/lag_mean": "mean lag of the trained samples (policy versions)",
    "async/lag_max": "largest lag among the trained samples (policy versions)",
    "async/token_lag": "streaming generators: histogram of trained tokens' lag (bin k counts tokens sampled k "
    "versions before the learner's)",
    "async/mixed_version_share": "streaming generators: share of trained responses whose tokens came from more "
    "than one policy version (weights loaded mid-response)",
    "async/buffered_groups": "scored prompt groups waiting in the rollout buffer after the step",
    "async/num_generators": "generators running when the step is logged (elastic jobs gain and lose them)",
    "perf/gen_tokens_per_s": "generated tokens per second over all generators",
    "perf/learner_tokens_per_s": "tokens (prompt and completion) the learner processed per second",
    "perf/micro_batches": "token-budget micro-batches the step ran (learner.max_tokens_per_micro_batch; mean "
    "over ranks)",
    "perf/learner_passes": "forwards over the batch: 1, or 2 when the stabilizer needed a no-grad pass first; "
    "1 + learner.epochs with algorithm.proximal recompute",
    "perf/weight_sync_s": "seconds to publish the new weights to the generators",
    "perf/weight_load_s": "seconds a generator takes to load one weight version into its engine (mean so far; "
    "it runs between the generator's calls, after the publish)",
    "fault/generator_restarts": "generator restarts so far in this run",
    "time/step_s": "seconds from starting the learner step to logging it",
    "time/learner_step_s": "seconds the learner spent in the step",
    "time/generator_busy_s": "generator seconds (generate calls and weight loads, summed over generators) "
    "reported since the previous step: over a run, its mean / generators is each generator's busy time per step",
    "time/eval_wait_s": "seconds the loop waited, after this step, for the previous evaluation to end before "
    "sending this step's (0 unless evaluation is slower than eval.every_steps steps)",
    WALL_KEY: "seconds since the metric sink started",
    "eval/reward_mean": "mean reward of the policy's answers on the fixed evaluation set (eval.every_steps)",
    "eval/solved": "share of evaluation answers with the full reward (correct); with eval.samples_per_problem k "
    "answers per problem, the mean over all of them (avg@k)",
    "eval/pass_at_k": "share of evaluation problems with at least one correct answer among their "
    "eval.samples_per_problem answers (pass@k; the same as eval/solved for one answer)",
    "eval/maj_at_k": "share of evaluation problems whose most frequent final answer among their "
    "eval.samples_per_problem answers is correct (maj@k; ties to the answer given first)",
    "eval/pass_at_K": "for each K of eval.pass_at: pass@K estimated without bias from the eval.samples_per_problem "
    "answers of each problem (1 - C(n - c, K) / C(n, K), c of n correct)",
    "eval/response_len": "mean length of the evaluation answers (tokens)",
    "eval/score_errors": "evaluation answers whose verifier failed (scored 0)",
    "eval/policy_version": "policy version the evaluation answers were generated with",
    "eval/problems": "problems in the evaluation set",
    "eval/answers": "answers scored in the evaluation: problems x samples_per_problem. Each named set of "
    "eval.sets logs every eval/* key of this table as eval/NAME/* in a row of its own (docs/tasks.md)",
    "eval/seconds": "seconds from sending the evaluation to its scored answers (training goes on meanwhile)",
    "sft/loss": "supervised warm-up loss (token-mean cross-entropy)",
    "sft/grad_norm": "supervised warm-up gradient norm",
}
HISTOGRAM_METRICS = frozenset({"async/lag", "async/token_lag"})  # logged as lists of counts, sent to W&B as histograms

# W&B run summaries beyond the default last value: the extreme that matters for each diagnostic.
# NaN wins min/max in W&B, so after a skipped step the grad-norm max reads NaN: look at the curve.
SUMMARIES: dict[str, str] = {
    "stability/ess_ratio": "min,last",
    "stability/lr_scale": "min,last",
    "stability/kl_k3": "max,last",
    "stability/kl_ref_mean": "max,last",
    "stability/entropy": "min,last",
    "stability/skipped_step": "max",
    "optim/grad_norm": "max,last",
    "rollout/reward_mean": "max,last",
    "eval/solved": "max,last",
    "eval/reward_mean": "max,last",
    "async/lag_max": "max",
    "perf/gen_tokens_per_s": "mean,last",
    "perf/learner_tokens_per_s": "mean,last",
    "perf/weight_sync_s": "mean,max",
    "perf/weight_load_s": "last",
    "time/step_s": "mean",
}


def metric_groups() -> list[str]:
    """The prefixes (W&B sections) of the known metrics; `train` holds only the step metric itself."""
    return sorted({key.split("/")[0] for key in KNOWN_METRICS} - {STEP_KEY.split("/")[0]})


PROGRESS_KEYS = (
    ("sft loss", "sft/loss", "{:.3f}"),  # the warm-up's
    ("reward", "rollout/reward_mean", "{:.3f}"),
    ("flat groups", "rollout/zero_std_share", "{:.0%}"),
    ("loss", "optim/loss", "{:.4f}"),
    ("kl", "stability/kl_k3", "{:.4f}"),
    ("entropy", "stability/entropy", "{:.2f}"),
    ("ess", "stability/ess_ratio", "{:.2f}"),
    ("lag", "async/lag_mean", "{:.1f}"),
    ("gen tok/s", "perf/gen_tokens_per_s", "{:.0f}"),
)


WandbMode = Literal["online", "offline", "disabled"]  # logging.wandb.mode


class MetricSink:
    """Writes each step's metrics to `metrics.jsonl`, W&B and a one-line progress display."""

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        config: dict[str, Any],
        wandb_mode: WandbMode = "offline",
        wandb_project: str = "stableasync",
        wandb_entity: str | None = None,
        progress_bar: bool = True,
        total_steps: int | None = None,
        alerts: AlertThresholds | None = None,
        warmup_steps: int = 0,
    ) -> None:
        """`alerts` (the job's `logging.alerts`) turns on the ESS-collapse and grad-norm-spike alerts;
        `warmup_steps`: the SFT warm-up's steps, logged as steps -warmup_steps .. -1 and shown as warm-up 1 .. N."""
        self.run_dir = run_dir
        self._alerts = StabilityAlerts(alerts) if alerts is not None else None
        self._jsonl = (run_dir / "metrics.jsonl").open("a")
        self.lines = _line_count(run_dir / "metrics.jsonl")  # rows so far (a resumed run has some)
        self._samples_path = run_dir / SAMPLES_FILE
        self.sample_lines = _line_count(self._samples_path)
        self._progress = progress_bar
        self._total = total_steps
        self._warmup_steps = warmup_steps
        self._started = time.monotonic()
        self._wandb = None
        if wandb_mode != "disabled":
            self._wandb = self._init_wandb(run_name, config, wandb_mode, wandb_project, wandb_entity)

    def _init_wandb(self, name: str, config: dict[str, Any], mode: WandbMode, project: str, entity: str | None) -> Any:
        try:
            import wandb

            run = wandb.init(
                project=project,
                entity=entity,
                name=name,
                mode=mode,
                dir=str(self.run_dir),
                config=config,
                reinit="finish_previous",
            )
            run.define_metric(STEP_KEY)
            for group in metric_groups():  # one W&B section per group, plotted against the policy version
                run.define_metric(f"{group}/*", step_metric=STEP_KEY)
            for key, summary in SUMMARIES.items():
                run.define_metric(key, step_metric=STEP_KEY, summary=summary)
            return run
        except Exception as error:
            log.warning(
                "W&B disabled for this run (%s: %s); metrics stay in %s",
                type(error).__name__,
                error,
                self.run_dir / "metrics.jsonl",
            )
            return None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step. Lists (histograms) go to JSONL as lists and to W&B as histograms. RL steps
        (step > 0) go through the stability alert rules; SFT warm-up steps have no ESS to judge."""
        row = self._write(step, metrics)
        if self._progress:
            self._print_progress(step, row)
        if self._alerts is not None and step > 0:
            for alert in self._alerts.check(step, metrics):
                self.alert(alert.title, alert.text)

    def log_evaluation(self, step: int, metrics: dict[str, Any]) -> None:
        """Record an evaluation of policy version `step` as its own row, written when it finishes (the steps
        after it may already be logged); only `eval/*` keys, see `is_evaluation_row`."""
        if not all(key.startswith(EVAL_PREFIX) for key in metrics):
            raise ValueError(f"an evaluation row holds eval/* metrics only, not {sorted(metrics)}")
        self._write(step, metrics)

    def _write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {STEP_KEY: step, WALL_KEY: round(time.monotonic() - self._started, 3), **metrics}
        self._jsonl.write(json.dumps(_jsonable(row)) + "\n")
        self._jsonl.flush()
        self.lines += 1
        if self._wandb is not None:
            try:
                self._wandb.log(_for_wandb(row))
            except Exception as error:
                log.warning("W&B logging failed (%s); continuing with JSONL only", error)
                self._wandb = None
        return row

    def log_samples(self, step: int, samples: list[RolloutSample]) -> None:
        """Append rollout samples to `samples.jsonl` (one line per response) and log them to W&B as a table."""
        rows = as_rows(samples)
        with self._samples_path.open("a") as out:
            out.writelines(json.dumps(_jsonable(row)) + "\n" for row in rows)
        self.sample_lines += len(rows)
        if self._wandb is None:
            return
        try:
            import wandb

            table = wandb.Table(columns=[*COLUMNS], data=[[row[name] for name in COLUMNS] for row in rows])
            self._wandb.log({STEP_KEY: step, SAMPLES_TABLE: table})
        except Exception as error:
            log.warning("W&B could not log the rollout samples (%s); they are in %s", error, self._samples_path)

    def alert(self, title: str, text: str) -> None:
        """A log line always; a W&B alert when W&B is up."""
        log.warning("ALERT %s: %s", title, text)
        if self._wandb is not None:
            with contextlib.suppress(Exception):
                self._wandb.alert(title=title, text=text, level="WARN")

    def close(self) -> None:
        """Close the JSONL file and the W&B run; on return the offline run file is complete on disk."""
        self._jsonl.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
                # In offline mode finish() returns before wandb-core's writer has saved the last records
                # (history, alerts, exit); its atexit hook may never run in a Ray worker. teardown()
                # waits for the service to close every run file.
                import wandb

                wandb.teardown()
            except Exception as error:
                log.warning("W&B finish failed: %s", error)

    def _print_progress(self, step: int, row: dict[str, Any]) -> None:
        if step < 0:
            parts = [f"warm-up {step + self._warmup_steps + 1}/{self._warmup_steps}"]
        else:
            parts = [f"step {step}" + (f"/{self._total}" if self._total else "")]
        for label, key, fmt in PROGRESS_KEYS:
            value = row.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                text = fmt.format(value)
                parts.append(f"{label} {text[1:] if text.startswith('-') and float(text.rstrip('%')) == 0 else text}")
        parts.append(f"{row['time/wall_s']:.0f}s elapsed")
        print(" | ".join(parts), file=sys.stderr, flush=True)


def _line_count(path: Path) -> int:
    """Lines of a JSONL file the sink appends to; 0 before its first line."""
    if not path.exists():
        return 0
    with path.open() as lines:
        return sum(1 for _ in lines)


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in row.items():
        if isinstance(value, float) and not math.isfinite(value):
            value = str(value)  # JSON has no NaN; keep the fact visible
        out[key] = value
    return out


def _for_wandb(row: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import wandb

    out = {}
    for key, value in row.items():
        if isinstance(value, list):
            counts = [float(v) for v in value]
            out[key] = wandb.Histogram(np_histogram=(np.asarray(counts), np.arange(len(counts) + 1)))
        else:
            out[key] = value
    return out
