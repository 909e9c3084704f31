"""Asynchronous speedup: the same job at max_lag 0 and at larger lags, side by side in one run.

    python -m benchmarks.async_speedup [--job deploy/jobs/demo.yaml] [--lags 0,1,2,4] [--steps 150]
                                       [--target-reward 0.5] [--out runs/bench-async]

One generator and one learner rank, each given one CPU (Ray resources) and one torch/OMP thread, on
a local 2-CPU Ray cluster; every run has the same seed, prompts and warm-up. Reported per lag:
- wall seconds per RL step (mean over the steps after the first 5, which pay first-call costs),
- the speedup over max_lag 0, and the share of the ideal speedup (g + t) / max(g, t) it reaches, where
  g (the generator's seconds per step: generate calls and its weight loads) and t (learner step +
  weight sync seconds) are measured in the max_lag 0 run,
- wall seconds until the trailing 10-step mean reward first reaches `--target-reward`,
- the simulator's step time for the run (`stableasync simulate --calibrate`, costs from the run's own
  phase measurements, never from its step time) and its error against the measured one,
- the same measured within each run alone, side by side with its own wall clock: the run's own g and
  t, its ideal (g + t) / max(g, t), the speedup it got over doing that same work one phase after the
  other, (g + t) / wall, and the share of its ideal that is, max(g, t) / wall (1.0: perfect overlap).
  Each lag trains its own policy, and what it learns changes the work per step (shorter answers make
  cheaper steps; the median response length is printed), so this share, unlike the one against the
  max_lag 0 run, does not mix the overlap with a different workload or a slower stretch of the machine.
- how much one busy core slows the other on this machine (`benchmarks.core_contention`): an async
  run keeps both busy, so its phases run slower than the synchronous ones the ideal is taken from.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks.core_contention import report, slowdown_with_both_cores_busy
from cluster.telemetry.run_files import metric_number, read_jsonl_rows, step_rows

SKIP_STEPS = 5  # warm-up: the first RL steps include engine and optimizer first-call costs


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's RL step rows: evaluation rows carry a `train/step` but no learner timings."""
    return step_rows(read_jsonl_rows(run_dir / "metrics.jsonl"))


def wall_per_step_s(rows: list[dict[str, Any]]) -> float:
    """Mean wall seconds per step after the warm-up: the clock from the row before the first steady step
    to the last row, over the steady steps (the interval the phase sums below cover)."""
    return (rows[-1]["time/wall_s"] - rows[SKIP_STEPS - 1]["time/wall_s"]) / (len(rows) - SKIP_STEPS)


def time_to_target_s(rows: list[dict[str, Any]], target: float, window: int = 10) -> float | None:
    rewards = [metric_number(r.get("rollout/reward_mean")) for r in rows]
    for i in range(window, len(rows) + 1):
        if statistics.fmean(rewards[i - window : i]) >= target:
            return rows[i - 1]["time/wall_s"] - rows[0]["time/wall_s"]
    return None


def phase_s(run_dir: Path, rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(g, t): the generator's busy seconds per step (its generate calls, plus the weight loads it runs
    between them) and the learner-plus-sync seconds per step of one run, both after the warm-up steps."""
    steady = rows[SKIP_STEPS:]
    if all("time/generator_busy_s" in r for r in steady):  # one generator: its seconds reported per step row
        g = statistics.fmean(metric_number(r["time/generator_busy_s"]) for r in steady)
    else:  # a run from before that metric: the whole run's generate calls, warm-up included
        summary = json.loads((run_dir / "summary.json").read_text())
        g = summary["generate_s"] / summary["steps"]
    t = statistics.fmean(
        metric_number(r["time/learner_step_s"]) + metric_number(r["perf/weight_sync_s"]) for r in steady
    )
    return g, t


def two_core_job(base: dict[str, Any], lag: int, steps: int, out: Path, run_name: str, **generator: Any) -> Any:
    """The base job on two cores, one learner rank and one generator (with `generator` settings over it), at
    `lag`, for `steps`, quiet, into `out/run_name`: what the timing benchmarks compare side by side."""
    from cluster.job import validate_job

    data = json.loads(json.dumps(base))
    data["async"]["max_lag"] = lag
    data["learner"].update(steps=steps, num_ranks=1, cpus_per_rank=1.0)
    data["generator"].update(num_generators=1, cpus_per_generator=1.0, **generator)
    data["cluster"].update(num_cpus=2)
    data["logging"].update(run_dir=str(out), run_name=run_name, progress_bar=False, wandb={"mode": "disabled"})
    return validate_job(data, run_name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--lags", default="0,1,2,4")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target-reward", type=float, default=0.5)
    parser.add_argument("--out", default="runs/bench-async")
    return parser


def print_own_phases(runs: dict[int, Path], rows: dict[int, list[dict[str, Any]]]) -> None:
    """Each lag's run against its own generator and learner phases (its ideal speedup, and how near it came)."""
    print("\neach run against its own phases:")
    print(
        f"{'max_lag':>7}{'own g s/step':>14}{'own t s/step':>14}{'response len':>14}{'own ideal':>11}"
        f"{'(g + t) / wall':>16}{'of own ideal':>14}"
    )
    for lag, run_dir in runs.items():
        own_g, own_t = phase_s(run_dir, rows[lag])
        wall = wall_per_step_s(rows[lag])
        length = statistics.median(metric_number(r["rollout/response_len"]) for r in rows[lag][SKIP_STEPS:])
        print(
            f"{lag:>7}{own_g:>14.3f}{own_t:>14.3f}{length:>14.1f}{(own_g + own_t) / max(own_g, own_t):>11.2f}"
            f"{(own_g + own_t) / wall:>16.2f}{max(own_g, own_t) / wall:>14.0%}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps <= SKIP_STEPS:
        parser.error(f"--steps must be above {SKIP_STEPS}: the first {SKIP_STEPS} steps are left out as warm-up")

    from cluster.experiments.simulate import calibrate, simulate
    from cluster.job import load_job
    from cluster.run.driver import train

    base = load_job(args.job).model_dump(mode="json", by_alias=True)
    out = Path(args.out)
    lags = [int(lag) for lag in args.lags.split(",")]
    if 0 not in lags:
        raise SystemExit("--lags must include 0: the ideal speedup is measured from the synchronous run")
    contention = slowdown_with_both_cores_busy()  # forks: before Ray starts its threads in this process
    runs = {}
    for lag in lags:  # one process, one Ray cluster, one job after the other
        runs[lag] = train(two_core_job(base, lag, args.steps, out, f"lag{lag}")).run_dir

    rows = {lag: _rows(run_dir) for lag, run_dir in runs.items()}
    g, t = phase_s(runs[0], rows[0])
    ideal = (g + t) / max(g, t)
    sync_wall = wall_per_step_s(rows[0])
    print(f"job {args.job}: {args.steps} steps per lag, 1 generator + 1 learner rank, one CPU and thread each")
    print(
        f"phases at max_lag 0: generator g (calls + weight loads) = {g:.3f} s/step, "
        f"learner + sync t = {t:.3f} s/step, "
        f"ideal speedup (g + t) / max(g, t) = {ideal:.2f}\n"
    )
    print(
        f"{'max_lag':>7}{'wall s/step':>13}{'speedup':>9}{'of ideal':>10}{'to target s':>13}"
        f"{'simulated s/step':>18}{'sim error':>11}"
    )
    for lag in lags:
        wall = wall_per_step_s(rows[lag])
        speedup = sync_wall / wall
        to_target = time_to_target_s(rows[lag], args.target_reward)
        config, measured = calibrate(runs[lag])
        predicted = simulate(config).step_s_mean
        error = (predicted - measured.step_s) / measured.step_s if measured.step_s else math.nan
        print(
            f"{lag:>7}{wall:>13.3f}{speedup:>9.2f}{speedup / ideal:>10.0%}"
            f"{(f'{to_target:.1f}' if to_target is not None else 'never'):>13}{predicted:>18.3f}{error:>+11.0%}"
        )
    print_own_phases(runs, rows)
    print(f"\n(simulated s/step is compared with the run's mean gap between step rows, {out}/lag*/metrics.jsonl)")
    print("\nthis machine with both cores busy (async phases run slower by about their memory-bound share):")
    print(report(contention))


if __name__ == "__main__":
    main()
