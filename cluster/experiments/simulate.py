"""`stableasync simulate`: predict step time, utilisation and lag of an asynchronous setting, to size a
cluster before renting it. This module holds what surrounds the model (simulate_model.py): the VCPO paper's
setting, calibration from a finished run, the printed prediction and the CLI. Commands: docs/simulator.md.
"""

from __future__ import annotations

import itertools
import math
import statistics
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from algorithms.errors import StableAsyncError
from cluster.experiments.simulate_model import CONFIG_FIELDS, SimConfig, SimResult, simulate, synchronous
from cluster.telemetry.run_files import STEP_KEY, WALL_KEY, metric_number, read_jsonl_rows, read_run_job, step_rows

# what the CLI, benchmarks/async_speedup.py, the tests and docs/simulator.md use from here
__all__ = [
    "CONFIG_FIELDS",
    "CalibrationError",
    "SimConfig",
    "SimResult",
    "calibrate",
    "run_cli",
    "simulate",
    "synchronous",
]


# ---- the VCPO paper's setting --------------------------------------------------------------------

PAPER_SPEEDUP = 2.5  # VCPO arXiv v1 abstract and Fig. 1: wall-clock to the synchronous run's best accuracy
PAPER_SYNC_STEPS, PAPER_SYNC_GPU_H = 300, 420.2  # README table, AIME-2025 multi-turn, synchronous k=0
PAPER_ASYNC_STEPS, PAPER_ASYNC_GPU_H = 220, 168.9  # same table, VCPO at k=2


def paper_config() -> SimConfig:
    """The VCPO multi-turn tool-use run (Qwen2.5-7B, k=2, 128 prompts x 16 responses, responses up to 12,288
    tokens, 2 rollout + 2 training GPUs). Shapes are the paper's scripts; every cost is our assumption
    for a 7B model on H100s (docs/simulator.md says why each)."""
    return SimConfig(
        generators=2,
        learners=2,
        max_lag=2,
        samples_per_prompt=16,
        prompts_per_request=64,
        prompts_per_step=128,
        steps=60,
        response_len_mean=4000.0,
        response_len_cv=0.9,
        max_response_len=12288,
        prompt_len=1024.0,
        gen_tokens_per_s=2500.0,
        gen_decode_step_s=0.012,
        gen_call_overhead_s=10.0,
        learner_tokens_per_s=4000.0,
        learner_overhead_s=30.0,
        sync_fixed_s=5.0,
        weight_bytes=15.2e9,
        sync_bytes_per_s=5e9,
        sync_waits_for_generation=True,
    )


# ---- calibration from a finished run ---------------------------------------------------------------


class CalibrationError(StableAsyncError, ValueError):
    """A run directory cannot be read for calibration; the message names the file."""


@dataclass(frozen=True)
class Measured:
    """What a real run measured, in the quantities the model predicts."""

    steps: int
    logged_step_s: float  # mean `time/step_s` over RL steps
    step_s: float | None  # mean time between consecutive RL rows (`time/wall_s`), when the run logged it
    lag_mean: float | None
    learner_step_s: float
    weight_sync_s: float
    gen_tokens_per_s: float  # per generator GPU
    learner_tokens_per_s: float  # per learner GPU
    response_len: float
    weight_load_s: float = 0.0  # one generator weight load (`perf/weight_load_s`; runs before it logged 0)


def _finite(rows: list[dict[str, Any]], key: str, path: Path) -> list[float]:
    values = [v for v in (metric_number(row.get(key)) for row in rows) if math.isfinite(v)]
    if not values:
        raise CalibrationError(f"{path}: no finite '{key}' in any RL step (train/step > 0)")
    return values


# long: each model cost is read from the run's own rows in turn, beside the comment that says how
def calibrate(run_dir: Path) -> tuple[SimConfig, Measured]:
    """The model's costs derived from a finished run's own measurements, and what it measured.

    Time per step is never an input, so the comparison tests the model rather than echoing a figure.
    """
    job = read_run_job(run_dir / "job.yaml", CalibrationError, defaulted=["generator", "learner", "async"])
    metrics = run_dir / "metrics.jsonl"
    rows = step_rows(read_jsonl_rows(metrics, CalibrationError))
    if not rows:
        raise CalibrationError(f"{metrics}: no RL steps (rows with train/step > 0)")
    g, learner, async_ = job["generator"], job["learner"], job["async"]
    try:
        shape = SimConfig(
            generators=int(g["num_generators"]),
            learners=int(learner["num_ranks"]),
            max_lag=int(async_["max_lag"]),
            stale_policy=async_["stale_policy"],
            fixed_lag=None if async_.get("fixed_lag") is None else int(async_["fixed_lag"]),
            samples_per_prompt=int(g["samples_per_prompt"]),
            prompts_per_request=int(g["prompts_per_request"]),
            prompts_per_step=int(learner["prompts_per_step"]),
            max_response_len=int(g["max_new_tokens"]),
            seed=int(job.get("seed", 0)),
        )
    except (TypeError, ValueError) as error:
        raise CalibrationError(f"{run_dir / 'job.yaml'}: {error}") from None

    learner_step_s = statistics.fmean(_finite(rows, "time/learner_step_s", metrics))
    _finite(rows, "perf/learner_tokens_per_s", metrics)
    # tokens one rank trained per step, each row's own rate x time (a mean of rates would weight short steps up)
    per_row = [
        metric_number(r.get("perf/learner_tokens_per_s")) * metric_number(r.get("time/learner_step_s")) for r in rows
    ]
    rank_tokens = statistics.fmean(t for t in per_row if math.isfinite(t))
    response_len = statistics.fmean(_finite(rows, "rollout/response_len", metrics))
    samples = shape.prompts_per_step * shape.samples_per_prompt
    # the logged rate is cumulative since the generators started (the last covers the whole run), times the
    # number of generators then (`async/num_generators` where the run logged it: elastic jobs vary it)
    gen_total = _finite(rows, "perf/gen_tokens_per_s", metrics)[-1]
    counts = [v for v in (metric_number(r.get("async/num_generators")) for r in rows) if math.isfinite(v) and v > 0]
    gen_per_gpu = gen_total / (counts[-1] if counts else shape.generators)
    sync_s = statistics.fmean(_finite(rows, "perf/weight_sync_s", metrics))
    lags = [v for v in (metric_number(r.get("async/lag_mean")) for r in rows) if math.isfinite(v)]
    loads = [v for v in (metric_number(r.get("perf/weight_load_s")) for r in rows) if math.isfinite(v)]
    measured = Measured(
        steps=len(rows),
        logged_step_s=statistics.fmean(_finite(rows, "time/step_s", metrics)),
        step_s=_measured_period(rows),
        lag_mean=statistics.fmean(lags) if lags else None,
        learner_step_s=learner_step_s,
        weight_sync_s=sync_s,
        gen_tokens_per_s=gen_per_gpu,
        learner_tokens_per_s=rank_tokens / learner_step_s,
        response_len=response_len,
        weight_load_s=loads[-1] if loads else 0.0,  # the logged value is the run's mean so far
    )
    collective = async_["weight_sync"] != "object_store"  # its publish waits for the loads: already in sync_s
    config = replace(
        shape,
        steps=max(2, min(len(rows), 5000)),
        response_len_mean=response_len,
        response_len_cv=0.0,
        prompt_len=max(0.0, rank_tokens * shape.learners / samples - response_len),
        gen_tokens_per_s=measured.gen_tokens_per_s,
        gen_decode_step_s=0.0,
        gen_call_overhead_s=0.0,
        learner_tokens_per_s=measured.learner_tokens_per_s,
        learner_overhead_s=0.0,
        gen_weight_load_s=0.0 if collective else measured.weight_load_s,
        sync_fixed_s=sync_s,
        weight_bytes=0.0,
        sync_waits_for_generation=collective,
    )
    return config, measured


def _measured_period(rows: list[dict[str, Any]]) -> float | None:
    """Mean wall-clock between consecutive RL rows (a resume restarts `time/wall_s`: those pairs are skipped)."""
    gaps = []
    for before, after in itertools.pairwise(rows):
        gap = metric_number(after.get(WALL_KEY)) - metric_number(before.get(WALL_KEY))
        if metric_number(after.get(STEP_KEY)) == metric_number(before.get(STEP_KEY)) + 1 and gap > 0:
            gaps.append(gap)
    return statistics.fmean(gaps) if gaps else None


# ---- printing ------------------------------------------------------------------------------------


def describe(result: SimResult, sync: SimResult | None = None) -> str:
    """The prediction as the CLI prints it; `sync`: the same setting at max_lag 0 (simulated when not given)."""
    c = result.config
    total = sum(result.lag_counts)
    lags = ", ".join(f"{lag}: {count / total:.0%}" for lag, count in enumerate(result.lag_counts))
    lines = [
        f"setting: {c.generators} generator GPU(s), {c.learners} learner GPU(s), "
        f"max_lag {c.max_lag} ({c.stale_policy}{'' if c.fixed_lag is None else f', fixed lag {c.fixed_lag}'}), "
        f"{c.prompts_per_step} prompts x {c.samples_per_prompt} responses per step, "
        f"{c.prompts_per_request} prompts per generate call; {c.steps} steps, seed {c.seed}",
        f"costs: generate call {result.gen_call_s_mean:.2f} s (mean), learner step {result.learner_s_mean:.2f} s, "
        f"weight sync {c.sync_s:.2f} s",
        f"step_s (wall-clock per learner step): mean {result.step_s_mean:.2f} s, median {result.step_s_median:.2f} s "
        f"(perfect overlap: {result.ideal_step_s:.2f} s)",
        f"time/step_s as the driver logs it: mean {result.logged_step_s_mean:.2f} s",
        f"utilisation: generators {result.generator_utilisation:.0%}, learner {result.learner_utilisation:.0%}",
        f"lag (share of trained responses): {lags}; mean {result.lag_mean:.2f}"
        + (f"; {result.dropped_groups} groups dropped stale" if result.dropped_groups else ""),
    ]
    if c != synchronous(c):
        sync = sync or simulate(synchronous(c))
        lines.append(
            f"synchronous (max_lag 0, wait): step_s mean {sync.step_s_mean:.2f} s -> "
            f"speedup {sync.step_s_mean / result.step_s_mean:.2f}x "
            f"(perfect overlap: {sync.step_s_mean / result.ideal_step_s:.2f}x)"
        )
    return "\n".join(lines)


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}" if measured else "n/a"


def describe_calibration(run_dir: Path, config: SimConfig, measured: Measured, result: SimResult) -> str:
    """Predicted next to measured, with the relative error, and the costs the prediction used."""
    lines = [
        f"calibrated from {run_dir} ({measured.steps} RL steps)",
        f"  generation: {measured.gen_tokens_per_s:.1f} tokens/s per generator (perf/gen_tokens_per_s per generator), "
        f"responses {measured.response_len:.1f} tokens (rollout/response_len)",
        f"  learner: {measured.learner_tokens_per_s:.1f} tokens/s per rank over {measured.learner_step_s:.3f} s "
        f"(time/learner_step_s), prompt {config.prompt_len:.1f} tokens per sample (derived)",
        f"  weight sync: {measured.weight_sync_s:.3f} s (perf/weight_sync_s)"
        + (
            ", waits for in-flight generation (collective)"
            if config.sync_waits_for_generation
            else f"; each generator then loads it in {config.gen_weight_load_s:.3f} s (perf/weight_load_s)"
        ),
        "",
        f"  {'':34}{'predicted':>10}{'measured':>10}{'error':>9}",
        f"  {'time/step_s (as the driver logs)':34}{result.logged_step_s_mean:>10.3f}{measured.logged_step_s:>10.3f}"
        f"{_error(result.logged_step_s_mean, measured.logged_step_s):>9}",
    ]
    if measured.step_s is not None:
        lines.append(
            f"  {'step period (time/wall_s)':34}{result.step_s_mean:>10.3f}{measured.step_s:>10.3f}"
            f"{_error(result.step_s_mean, measured.step_s):>9}"
        )
    else:
        lines.append(f"  {'step period (time/wall_s)':34}{result.step_s_mean:>10.3f}{'-':>10}")
    if measured.lag_mean is not None:
        lines.append(f"  {'async/lag_mean':34}{result.lag_mean:>10.3f}{measured.lag_mean:>10.3f}")
    lines.append(
        f"  predicted utilisation: generators {result.generator_utilisation:.0%}, "
        f"learner {result.learner_utilisation:.0%}"
    )
    return "\n".join(lines)


def describe_paper(result: SimResult) -> str:
    """Our model's prediction for the VCPO setting beside the paper's reported figures, each labelled."""
    per_step = (PAPER_SYNC_GPU_H / PAPER_SYNC_STEPS) / (PAPER_ASYNC_GPU_H / PAPER_ASYNC_STEPS)
    step_ratio = PAPER_SYNC_STEPS / PAPER_ASYNC_STEPS
    sync = simulate(synchronous(result.config))
    speedup = sync.step_s_mean / result.step_s_mean
    return "\n".join(
        [
            "VCPO paper setting: multi-turn tool use, Qwen2.5-7B, max_lag (k) 2; shapes from the paper's scripts,",
            "costs assumed by us for H100s (docs/simulator.md)",
            "",
            describe(result, sync),
            "",
            f"paper's figure: {PAPER_SPEEDUP}x less wall-clock to reach the synchronous run's best AIME-2025 accuracy "
            "(arXiv v1, Fig. 1)",
            f"  from the paper's README: {per_step:.2f}x per step ({PAPER_SYNC_GPU_H} GPU-h / {PAPER_SYNC_STEPS} steps "
            f"sync vs {PAPER_ASYNC_GPU_H} GPU-h / {PAPER_ASYNC_STEPS} steps at k=2) x {step_ratio:.2f}x fewer steps",
            f"our model's prediction: {speedup:.2f}x per step",
            f"  x the paper's step ratio {step_ratio:.2f} (not modelled: it comes from learning, not scheduling) "
            f"= {speedup * step_ratio:.2f}x wall-clock",
        ]
    )


def run_cli(calibrate_dir: str | None, paper: bool, overrides: dict[str, Any]) -> int:
    """`stableasync simulate`: print a prediction; exit 2 on a bad setting or run directory."""
    try:
        if calibrate_dir is not None:
            run_dir = Path(calibrate_dir)
            if not run_dir.is_dir():
                raise CalibrationError(f"{run_dir}: not a directory (give a finished run directory)")
            config, measured = calibrate(run_dir)
            print(describe_calibration(run_dir, config, measured, simulate(config)))
            if overrides:
                print(f"\nwhat if {', '.join(f'{k}={v}' for k, v in overrides.items())}:")
                print(describe(simulate(replace(config, **overrides))))
            return 0
        base = paper_config() if paper else SimConfig()
        result = simulate(replace(base, **overrides))
        print(describe_paper(result) if paper else describe(result))
        return 0
    except ValueError as error:  # CalibrationError included
        print(f"stableasync simulate: {error}", file=sys.stderr)
        return 2
