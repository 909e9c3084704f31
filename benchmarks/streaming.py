"""Streaming against request-batch generators: the same job twice, side by side in one run.

    python -m benchmarks.streaming [--job deploy/jobs/demo.yaml] [--steps 60] [--max-lag 1]
                                   [--requests-in-flight 4] [--target-reward 0.5] [--out runs/bench-streaming]

Both runs have one generator and one learner rank (one CPU each, as `benchmarks.async_speedup`), the same
seed, prompts and warm-up, and the job's `max_lag`. The request-batch run samples `prompts_per_request`
groups per blocking call, as the job says; the streaming run keeps `--requests-in-flight` calls of one group
each in its AsyncLLM engine and loads weights beside them. Printed per run: wall seconds per RL step after
the first 5 (first-call costs), the streaming run's speedup over the request-batch one, wall seconds until
the trailing 10-step mean reward reaches `--target-reward`, the median response length and the share of
trained responses that more than one policy version sampled.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from benchmarks.async_speedup import SKIP_STEPS, time_to_target_s, two_core_job, wall_per_step_s
from cluster.telemetry.run_files import metric_number, read_jsonl_rows, step_rows


def _job_for(base: dict[str, Any], streaming: bool, steps: int, lag: int, requests_in_flight: int, out: Path) -> Any:
    """The request-batch job, or its streaming twin with one prompt per request and `requests_in_flight` of them."""
    if not streaming:
        return two_core_job(base, lag, steps, out, "request-batch", streaming=False)
    return two_core_job(
        base, lag, steps, out, "streaming", streaming=True, prompts_per_request=1, requests_in_flight=requests_in_flight
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", default="deploy/jobs/demo.yaml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-lag", type=int, default=1)
    parser.add_argument("--requests-in-flight", type=int, default=4)
    parser.add_argument("--target-reward", type=float, default=0.5)
    parser.add_argument("--out", default="runs/bench-streaming")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.steps <= SKIP_STEPS:
        parser.error(f"--steps must be above {SKIP_STEPS}: the first {SKIP_STEPS} steps are left out as warm-up")

    from cluster.job import load_job
    from cluster.run.driver import train

    base = load_job(args.job).model_dump(mode="json", by_alias=True)
    out = Path(args.out)
    runs = {
        streaming: train(_job_for(base, streaming, args.steps, args.max_lag, args.requests_in_flight, out)).run_dir
        for streaming in (False, True)
    }  # one process, one Ray cluster, one job after the other
    rows = {streaming: step_rows(read_jsonl_rows(run_dir / "metrics.jsonl")) for streaming, run_dir in runs.items()}
    batch_wall = wall_per_step_s(rows[False])
    print(
        f"job {args.job}: {args.steps} steps, max_lag {args.max_lag}, 1 generator + 1 learner rank; streaming: "
        f"{args.requests_in_flight} calls of one group in flight\n"
    )
    print(
        f"{'generator':>13}{'wall s/step':>13}{'speedup':>9}{'to target s':>13}{'response len':>14}{'mixed share':>13}"
    )
    for streaming, name in ((False, "request-batch"), (True, "streaming")):
        wall = wall_per_step_s(rows[streaming])
        to_target = time_to_target_s(rows[streaming], args.target_reward)
        length = statistics.median(metric_number(r.get("rollout/response_len")) for r in rows[streaming])
        mixed = [
            metric_number(r["async/mixed_version_share"]) for r in rows[streaming] if "async/mixed_version_share" in r
        ]
        print(
            f"{name:>13}{wall:>13.3f}{batch_wall / wall:>9.2f}"
            f"{(f'{to_target:.1f}' if to_target is not None else 'never'):>13}{length:>14.1f}"
            f"{(f'{statistics.fmean(mixed):.3f}' if mixed else '-'):>13}"
        )


if __name__ == "__main__":
    main()
