"""`stableasync`: train, validate, evaluate, submit (status, logs, stop), sweep, report, soak, simulate and
prepare-model.

Validation imports no torch or ray, so `stableasync validate` answers in well under a second.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from algorithms.errors import StableAsyncError
from cluster import cli_outputs
from cluster.cli_outputs import JOB_HELP, add_set_option, load_or_print
from cluster.job import JobValidationError, dump_job

# the commands on a job's outputs or model, each parser beside its handler in cluster/cli_outputs.py
OUTPUT_COMMANDS = [
    cli_outputs.add_simulate_parser,
    cli_outputs.add_sweep_parser,
    cli_outputs.add_report_parser,
    cli_outputs.add_wandb_workspace_parser,
    cli_outputs.add_export_parser,
    cli_outputs.add_evaluate_parser,
    cli_outputs.add_prepare_model_parser,
]


def _add_validate_parser(commands: Any) -> None:
    """`stableasync validate` and its flags."""
    validate = commands.add_parser("validate", help="check a job file; every error with its field path")
    validate.add_argument("job", help=JOB_HELP)
    add_set_option(validate)
    validate.add_argument("--dry-run", action="store_true", help="print the resolved job")
    validate.add_argument(
        "--schema-only",
        action="store_true",
        help="check the file alone, not the task's data "
        "and reward function (a job whose data is on the cluster it is submitted to)",
    )
    validate.set_defaults(run=_validate)


def _validate(args: argparse.Namespace) -> int:
    job = load_or_print(args.job, args.set)
    if job is None:
        return 2
    from cluster.job import check_sandbox, evaluation_sets, job_task
    from learner.models import ModelPathError
    from tasks.base import TaskError

    data_read = None
    try:  # the data file's rows, the reward function, a local model folder and reward models, as a run would load
        if not args.schema_only:
            from cluster.run.model_prep import check_model, check_tools
            from cluster.run.rewards import check_first_score, check_reward_models

            task = job_task(job)
            data_read = task.data_read()
            evaluation_sets(job, task, always=bool(job.eval.sets))  # named sets: also for `evaluate`
            check_first_score(job, task)
            check_model(job)
            check_reward_models(job)
            check_tools(job)
            check_sandbox(job, args.job)
    except (TaskError, ModelPathError) as error:
        print(f"{args.job}: {error}", file=sys.stderr)
        return 2
    except JobValidationError as error:
        print(error, file=sys.stderr)
        return 2
    if args.dry_run:
        print(dump_job(job), end="")
    else:
        read = f", {data_read}" if data_read else ""
        print(
            f"{args.job}: ok ({job.algorithm.stabilizer.name}, max_lag {job.async_.max_lag}, "
            f"{job.generator.num_generators} generator(s), {job.learner.num_ranks} learner rank(s){read})"
        )
    return 0


def _add_train_parser(commands: Any) -> None:
    """`stableasync train` and its flags."""
    train = commands.add_parser("train", help="run a job on the current Ray cluster (local by default)")
    train.add_argument("job", nargs="?", help=JOB_HELP)
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    add_set_option(train)
    train.set_defaults(run=_train)


def _train(args: argparse.Namespace) -> int:
    if (args.job is None) == (args.resume is None):
        print("give a job file, or --resume RUN_DIR (its job.yaml is used)", file=sys.stderr)
        return 2
    if args.resume and args.set:
        print("--set changes a job file before it starts; a resumed run keeps its own job.yaml", file=sys.stderr)
        return 2
    resume_dir = Path(args.resume) if args.resume else None
    job = load_or_print(str(resume_dir / "job.yaml") if resume_dir else args.job, args.set)
    if job is None:
        return 2
    from cluster.run.driver import run_job
    from cluster.run.faults import RunHalted
    from cluster.run.stopping import JobStopped, stop_on_signals
    from learner.models import ModelPathError
    from tasks.base import TaskError

    with stop_on_signals() as stop:
        try:
            result = run_job(job, resume_dir, stop)
        except JobStopped as stopped:
            print(stopped, file=sys.stderr)
            return stopped.exit_code
        except (TaskError, ModelPathError, JobValidationError) as error:  # raised before anything starts
            print(f"stableasync train: {error}", file=sys.stderr)
            return 2
        except RunHalted as halted:  # the run stopped itself with a checkpoint; the message says what to fix
            print(f"stableasync train: {halted}", file=sys.stderr)
            return 1
    print(f"run directory: {result.run_dir}")
    if result.model_dir is not None:
        print(f"trained model: {result.model_dir}")
    print(f"ledger: {result.ledger_counts}")
    if result.model_error is not None:  # every step ran, but what the user asked for at the end is missing
        print(f"stableasync train: the run finished, but {result.model_error}", file=sys.stderr)
        return 1
    return 0


def _add_soak_parser(commands: Any) -> None:
    """`stableasync soak` and its flags."""
    soak = commands.add_parser("soak", help="a long run with generators killed every so often; audits the ledger")
    soak.add_argument("job", help=JOB_HELP)
    add_set_option(soak)
    soak.add_argument(
        "--steps", type=int, default=6000, help="learner steps (about 0.25 s each for the demo on 2 cores)"
    )
    soak.add_argument("--kill-every-s", type=float, default=120.0, help="seconds between generator kills (+-25%%)")
    soak.set_defaults(run=_soak)


def _soak(args: argparse.Namespace) -> int:
    job = load_or_print(args.job, args.set)
    if job is None:
        return 2
    from cluster.experiments.soak import soak

    return soak(job, args.steps, args.kill_every_s)


def _jobs_api(args: argparse.Namespace) -> tuple[str, str | None] | None:
    """The Jobs API address and auth token of a cluster command, or None after saying what is missing."""
    from cluster.remote.submit import SubmitError, find_token

    address = args.address or os.environ.get("RAY_API_SERVER_ADDRESS")
    if not address:
        print("give --address http://HEAD:8265 (or set RAY_API_SERVER_ADDRESS)", file=sys.stderr)
        return None
    try:
        return address, None if args.no_auth else find_token(args.token_file)
    except SubmitError as error:
        print(error, file=sys.stderr)
        return None


def _add_submit_parser(commands: Any) -> None:
    """`stableasync submit` and its flags."""
    submit = commands.add_parser("submit", help="run a job on a remote Ray cluster (Ray Jobs API, token auth)")
    submit.add_argument("job", help=JOB_HELP)
    add_set_option(submit)
    _add_cluster_options(submit)
    submit.add_argument("--run-dir", default="~/stableasync/runs", help="parent of the run directory on the head node")
    submit.add_argument(
        "--remote-prefix",
        action="append",
        metavar="PREFIX",
        help="the job's paths under PREFIX (absolute, or ~/...: the nodes' home) are on the cluster "
        "already and not uploaded; repeatable, beside /mnt/shared and ~/stableasync",
    )
    submit.add_argument("--wait", action="store_true", help="block until the job ends; exit 0 only if it succeeded")
    submit.add_argument("--timeout-s", type=float, default=24 * 3600.0, help="how long --wait waits")
    submit.set_defaults(run=_submit)


def _submit(args: argparse.Namespace) -> int:
    from cluster.remote.submit import DEFAULT_REMOTE_PREFIXES, SubmitError, submit, wait

    job = load_or_print(args.job, args.set)
    api = _jobs_api(args) if job is not None else None
    if job is None or api is None:
        return 2
    try:
        submission = submit(
            job, *api, run_dir=args.run_dir, remote_prefixes=(*DEFAULT_REMOTE_PREFIXES, *(args.remote_prefix or ()))
        )
        print(f"submitted {submission.submission_id}; run directory on the head node: {submission.run_dir}")
        print(f"  stableasync status {submission.submission_id} --address {api[0]}")
        print(f"  stableasync logs {submission.submission_id} --address {api[0]} --follow")
        if args.wait:
            status = wait(*api, submission.submission_id, args.timeout_s)
            print(f"{submission.submission_id}: {status}")
            return 0 if status == "SUCCEEDED" else 1
    except SubmitError as error:
        print(error, file=sys.stderr)
        return 1
    return 0


def _add_cluster_job_parser(commands: Any) -> None:
    """`status`, `logs` and `stop` of a submitted job."""
    for name, text in (
        ("status", "a submitted job's status"),
        ("logs", "a submitted job's driver log"),
        ("stop", "stop a submitted job"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("submission_id", help="what `stableasync submit` printed (raysubmit_...)")
        _add_cluster_options(command)
        if name == "logs":
            command.add_argument("--follow", action="store_true", help="stream the log until the job ends")
        command.set_defaults(run=_cluster_job)


def _cluster_job(args: argparse.Namespace) -> int:
    """status, logs and stop of a submitted job."""
    from cluster.remote.submit import SubmitError, client

    api = _jobs_api(args)
    if api is None:
        return 2
    try:
        jobs = client(*api)
        if args.command == "status":
            info = jobs.get_job_info(args.submission_id)
            print(f"{args.submission_id}: {info.status.value}" + (f" ({info.message})" if info.message else ""))
        elif args.command == "stop":
            stopped = jobs.stop_job(args.submission_id)
            print(f"{args.submission_id}: {'stopping' if stopped else 'already ended'}")
        elif args.follow:
            import asyncio

            async def tail() -> None:
                async for lines in jobs.tail_job_logs(args.submission_id):
                    print(lines, end="", flush=True)

            asyncio.run(tail())
        else:
            print(jobs.get_job_logs(args.submission_id), end="")
    except SubmitError as error:
        print(error, file=sys.stderr)
        return 1
    except Exception as error:
        print(f"{args.submission_id}: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _add_cluster_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", help="the Ray Jobs API, http://HEAD:8265 (default: $RAY_API_SERVER_ADDRESS)")
    parser.add_argument(
        "--token-file",
        help="the cluster's auth token (default: $RAY_AUTH_TOKEN, $RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)",
    )
    parser.add_argument("--no-auth", action="store_true", help="for a cluster without token authentication")


def build_parser() -> argparse.ArgumentParser:
    """Every command and its flags (`main` runs the one given; tests parse the documented commands with it)."""
    parser = argparse.ArgumentParser(prog="stableasync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_commands = [_add_train_parser, _add_validate_parser, _add_soak_parser, _add_submit_parser]
    for add in [*run_commands, _add_cluster_job_parser, *OUTPUT_COMMANDS]:
        add(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args)
    except StableAsyncError as error:  # explained failures: their message, not a traceback; anything else is a bug
        logging.getLogger("stableasync").debug("%s", error, exc_info=True)
        print(f"stableasync {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
