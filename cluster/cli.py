"""`stableasync`: train, validate and prepare-model.

Validation imports no torch or ray, so `stableasync validate` answers in well under a second.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from cluster.job import Job, JobValidationError, dump_job, load_job


def _load(path: str) -> Job | None:
    """The validated job, or None after printing every error (the caller exits 2, nothing started)."""
    try:
        return load_job(path)
    except JobValidationError as error:
        print(error, file=sys.stderr)
        return None


def _validate(args: argparse.Namespace) -> int:
    job = _load(args.job)
    if job is None:
        return 2
    if args.dry_run:
        print(dump_job(job), end="")
    else:
        print(f"{args.job}: ok ({job.algorithm.stabilizer.name}, max_lag {job.async_.max_lag}, "
              f"{job.generator.num_generators} generator(s), {job.learner.num_ranks} learner rank(s))")
    return 0


def _train(args: argparse.Namespace) -> int:
    if (args.job is None) == (args.resume is None):
        print("give a job file, or --resume RUN_DIR (its job.yaml is used)", file=sys.stderr)
        return 2
    resume_dir = Path(args.resume) if args.resume else None
    job = _load(str(resume_dir / "job.yaml") if resume_dir else args.job)
    if job is None:
        return 2
    from cluster.driver import run_job

    result = run_job(job, resume_dir)
    print(f"run directory: {result.run_dir}")
    print(f"ledger: {result.ledger_counts}")
    return 0


def _soak(args: argparse.Namespace) -> int:
    job = _load(args.job)
    if job is None:
        return 2
    from cluster.soak import soak

    return soak(job, args.steps, args.kill_every_s)


def _prepare_model(args: argparse.Namespace) -> int:
    from learner.models import KNOWN_MODELS

    if args.name not in KNOWN_MODELS:
        print(f"unknown model {args.name!r}; known: {', '.join(sorted(KNOWN_MODELS))}", file=sys.stderr)
        return 2
    print(KNOWN_MODELS[args.name]())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stableasync", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="run a job on the current Ray cluster (local by default)")
    train.add_argument("job", nargs="?")
    train.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    train.set_defaults(run=_train)
    validate = commands.add_parser("validate", help="check a job file; every error with its field path")
    validate.add_argument("job")
    validate.add_argument("--dry-run", action="store_true", help="print the resolved job")
    validate.set_defaults(run=_validate)
    soak = commands.add_parser("soak", help="a long run with generators killed every so often; audits the ledger")
    soak.add_argument("job")
    soak.add_argument("--steps", type=int, default=6000, help="learner steps (about 0.25 s each for the demo on 2 cores)")
    soak.add_argument("--kill-every-s", type=float, default=120.0, help="seconds between generator kills (+-25%%)")
    soak.set_defaults(run=_soak)
    prepare = commands.add_parser("prepare-model", help="build a known model offline into the cache")
    prepare.add_argument("name")
    prepare.set_defaults(run=_prepare_model)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
