"""Jobs on a remote Ray cluster through the Ray Jobs API, with token authentication.

`stableasync submit JOB.yaml --address http://HEAD:8265` packs the project's code and the resolved job
into the Ray job's `working_dir`, and runs `python -m cluster.cli train job.yaml` as the job's driver
on the head node, under `cluster.remote.job_entrypoint` (so that `stop` signals the driver alone); the driver
joins the cluster it runs in (RAY_ADDRESS). The plain Ray equivalent is `ray job submit --address ...
--working-dir DIR -- python -m cluster.remote.job_entrypoint python -m cluster.cli train job.yaml`.

Token authentication is on by default: the token comes from `--token-file`, `RAY_AUTH_TOKEN`,
`RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token` (Ray's own places), and goes in the `Authorization`
header of every request. `--no-auth` is for clusters that run without it (never on a shared network).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from algorithms.errors import StableAsyncError
from cluster.job import Job, dump_job

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# What a job needs on the cluster: the importable packages and the project metadata.
PACKAGES = ("algorithms", "actors", "cluster", "learner", "tasks")
PROJECT_FILES = ("pyproject.toml",)
DEFAULT_RUN_DIR = "~/stableasync/runs"  # on the head node, outside the job's temporary working_dir


class SubmitError(StableAsyncError, RuntimeError):
    """A submission that cannot go ahead, with what to do about it."""


@dataclass(frozen=True)
class Submission:
    submission_id: str
    run_dir: str  # on the head node


def find_token(token_file: str | None = None) -> str:
    """The cluster's auth token, from the first of: `token_file`, RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH,
    ~/.ray/auth_token. Raises SubmitError naming every place looked at."""
    candidates: list[tuple[str, str | None]] = []
    if token_file:
        candidates.append((f"--token-file {token_file}", _read(Path(token_file).expanduser())))
    else:
        candidates.append(("RAY_AUTH_TOKEN", os.environ.get("RAY_AUTH_TOKEN")))
        if os.environ.get("RAY_AUTH_TOKEN_PATH"):
            path = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).expanduser()
            candidates.append((f"RAY_AUTH_TOKEN_PATH ({path})", _read(path)))
        default = Path.home() / ".ray" / "auth_token"
        candidates.append((str(default), _read(default)))
    for _, token in candidates:
        if token:
            return token
    looked = ", ".join(name for name, _ in candidates)
    raise SubmitError(f"no Ray auth token found (looked at {looked}); copy the cluster's token there, "
                      "or pass --token-file (the deploy YAMLs print where the head keeps it)")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def client(address: str, token: str | None) -> Any:
    """A JobSubmissionClient for `address` that sends the token with every request."""
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=auth_headers(token))
    except Exception as error:  # noqa: BLE001 - connection, auth and version errors all end the command
        raise SubmitError(f"cannot reach the Ray Jobs API at {address}: {type(error).__name__}: {error}") from None


def stage_working_dir(job: Job, destination: Path) -> Path:
    """Copy the project's packages and the resolved job into `destination` (the job's working_dir)."""
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(PROJECT_ROOT / package, destination / package, ignore=ignore)
    for name in PROJECT_FILES:
        shutil.copy2(PROJECT_ROOT / name, destination / name)
    (destination / "job.yaml").write_text(dump_job(job))
    return destination


def for_cluster(job: Job, submission_id: str, run_dir: str) -> Job:
    """The job as the cluster runs it: run directory on the head node, named after the submission."""
    logging_section = job.logging.model_copy(update={"run_dir": run_dir, "run_name": submission_id})
    # The driver joins the cluster it was submitted to; a local address or CPU count would be wrong there.
    cluster_section = job.cluster.model_copy(update={"address": None, "num_cpus": None})
    return job.model_copy(update={"logging": logging_section, "cluster": cluster_section})


# The driver runs under the entrypoint that keeps Ray's stop signal off the W&B service the driver starts.
JOB_ENTRYPOINT = "python -m cluster.remote.job_entrypoint python -m cluster.cli train job.yaml"


def stop_env(job: Job) -> dict[str, str]:
    """How `stop` ends the job, read by Ray's job supervisor: SIGINT, as Ctrl-C would (`cluster.remote.job_entrypoint`
    passes it on to the driver alone), and time to finish the step and checkpoint before Ray kills it (3 s by
    default)."""
    return {"RAY_JOB_STOP_SIGNAL": "SIGINT", "RAY_JOB_STOP_WAIT_TIME_S": str(job.checkpoint.stop_grace_s)}


def submit(job: Job, address: str, token: str | None, run_dir: str = DEFAULT_RUN_DIR,
           submission_id: str | None = None) -> Submission:
    """Submit `job` to the cluster; returns at once with the submission id (the run keeps going there)."""
    submission_id = submission_id or f"{job.name}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    cluster_job = for_cluster(job, submission_id, run_dir)
    jobs = client(address, token)
    with tempfile.TemporaryDirectory(prefix="stableasync-submit-") as staging:
        working_dir = stage_working_dir(cluster_job, Path(staging))
        try:
            jobs.submit_job(
                entrypoint=JOB_ENTRYPOINT,
                submission_id=submission_id,
                runtime_env={"working_dir": str(working_dir), "env_vars": stop_env(job)},
                metadata={"stableasync_job": job.name, "stabilizer": job.algorithm.stabilizer.name},
            )
        except Exception as error:  # noqa: BLE001
            raise SubmitError(f"the cluster at {address} refused job {job.name!r}: {type(error).__name__}: "
                              f"{error}") from None
    return Submission(submission_id, f"{run_dir}/{submission_id}")


def wait(address: str, token: str | None, submission_id: str, timeout_s: float, poll_s: float = 2.0) -> str:
    """Block until the job ends (or `timeout_s` passes); its final status name."""
    import time

    jobs, deadline = client(address, token), time.monotonic() + timeout_s
    while True:
        status = jobs.get_job_status(submission_id)
        if status.is_terminal() or time.monotonic() > deadline:
            return str(status.value)
        time.sleep(poll_s)
