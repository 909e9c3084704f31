"""Jobs on a remote Ray cluster through the Ray Jobs API, with token authentication.

`stableasync submit JOB.yaml --address http://HEAD:8265` packs the project's code and the resolved job
into the Ray job's `working_dir`, and runs `python -m cluster.cli train job.yaml` as the job's driver
on the head node, under `cluster.remote.job_entrypoint` (so that `stop` signals the driver alone); the driver
joins the cluster it runs in (RAY_ADDRESS). The plain Ray equivalent is `ray job submit --address ...
--working-dir DIR -- python -m cluster.remote.job_entrypoint python -m cluster.cli train job.yaml`.

The files the job reads travel with it: its data file (`task.path`), a reward function given as
`FILE.py:NAME` (`task.reward`) and the evaluation sets' data files (`eval.task_path`, `eval.sets.NAME.path`) are
copied into the working_dir under `user_files/`, and the job the cluster runs names them there (relative paths:
the driver runs in the working_dir). A path under a remote prefix (absolute, or `~` for the home directory on the
cluster's nodes: `/mnt/shared` and `~/stableasync` by default, more with `--remote-prefix`) is on the
cluster already and left as it is. The working_dir must stay under Ray's upload limit (`upload_limit_bytes`).

Token authentication is on by default: the token comes from `--token-file`, `RAY_AUTH_TOKEN`,
`RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token` (Ray's own places), and goes in the `Authorization`
header of every request. `--no-auth` is for clusters that run without it (never on a shared network).
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import Any

from algorithms.errors import StableAsyncError
from cluster.job import Job, JobValidationError, dump_job, validate_job
from tasks.config import is_hub_dataset

PROJECT_ROOT = Path(__file__).resolve().parents[2]
# What a job needs on the cluster: the importable packages and the project metadata.
PACKAGES = ("algorithms", "actors", "cluster", "learner", "tasks")
PROJECT_FILES = ("pyproject.toml",)
DEFAULT_RUN_DIR = "~/stableasync/runs"  # on the head node, outside the job's temporary working_dir
# Where the job's files already are on every node: the deploy YAMLs' shared storage and the repository
# `ray up` syncs to every node (`~` is the home directory on the node, as the job's paths spell it).
DEFAULT_REMOTE_PREFIXES = ("/mnt/shared", "~/stableasync")
USER_FILES = "user_files"  # the working_dir's folder of the files the job names


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
    raise SubmitError(
        f"no Ray auth token found (looked at {looked}); copy the cluster's token there, "
        "or pass --token-file (the deploy YAMLs print where the head keeps it)"
    )


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def auth_headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def client(address: str, token: str | None) -> Any:
    """A JobSubmissionClient for `address` that sends the token with every request."""
    from ray.exceptions import AuthenticationError
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address, headers=auth_headers(token))
    except AuthenticationError as error:
        raise SubmitError(token_refused(address, token, error.message)) from None
    except Exception as error:
        raise SubmitError(f"cannot reach the Ray Jobs API at {address}: {type(error).__name__}: {error}") from None


def token_refused(address: str, token: str | None, said: str) -> str:
    """Why the cluster refused us, in words about this cluster's token. Ray's own text goes on about the local
    RAY_AUTH_MODE ('currently disabled'), which is not what is wrong when a cluster refuses a token."""
    sent = "the auth token sent" if token else "a request without an auth token (--no-auth)"
    return (
        f"Authentication refused by the Ray cluster at {address} ({said.strip().rstrip('.')}): {sent} is not "
        "the cluster's; use the head's own token (its ~/.ray/auth_token, which the deploy YAMLs print), with "
        "--token-file, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"
    )


def upload_limit_bytes() -> int:
    """Ray's limit on one uploaded runtime_env package, working_dir included: its GCS_STORAGE_MAX_SIZE (the
    gRPC message size, 512 MiB unless RAY_max_grpc_message_size says otherwise). Read here only."""
    from ray._private.runtime_env import packaging

    return int(packaging.GCS_STORAGE_MAX_SIZE)


@dataclass(frozen=True)
class CarriedFile:
    """A local file a job names, and where it goes in the working_dir."""

    fields: tuple[str, ...]  # the job's fields that name it, as job.yaml spells them: task.path, task.reward, ...
    source: Path  # on this machine
    staged: str  # relative to the working_dir, the driver's cwd


def job_files(job: Job) -> list[tuple[str, str]]:
    """(field, path as the job writes it) of every file the job reads: the task's data file, a reward function's
    FILE.py, the evaluation sets' data files and the tools' FILE.py. A model (model.path) is not among them: a
    hub id, a known name, or a folder on every node (docs/cluster.md, Shared storage)."""
    files = []
    if getattr(job.task, "path", ""):
        files.append(("task.path", job.task.path))
    source = getattr(job.task, "reward", "").rpartition(":")[0]  # 'FILE.py:NAME'; 'module:NAME' is imported
    if source.endswith(".py"):
        files.append(("task.reward", source))
    if job.eval.task_path:
        files.append(("eval.task_path", job.eval.task_path))
    files += [(f"eval.sets.{name}.path", spec.path) for name, spec in job.eval.sets.items()]
    files += [
        (f"environment.tools.{index}", entry.rpartition(":")[0])
        for index, entry in enumerate(job.environment.tools)
        if entry.rpartition(":")[0].endswith(".py")
    ]  # a tool's FILE.py
    return [(field, path) for field, path in files if not is_hub_dataset(path)]  # read from each node's cache


def _prefix_parts(prefix: str) -> tuple[str, ...]:
    if not (prefix.startswith("/") or prefix == "~" or prefix.startswith("~/")):
        raise SubmitError(
            f"remote prefix {prefix!r} must be an absolute path, or start with ~ (the home directory "
            "on the cluster's nodes)"
        )
    return PurePosixPath(os.path.normpath(prefix)).parts


def is_remote(path: str, prefixes: Sequence[str] = DEFAULT_REMOTE_PREFIXES) -> bool:
    """Whether `path`, as the job writes it, is under a remote prefix: on the cluster already, not carried."""
    if not (path.startswith("/") or path.startswith("~")):
        return False
    parts = PurePosixPath(os.path.normpath(path)).parts
    return any(parts[: len(prefix)] == prefix for prefix in map(_prefix_parts, prefixes))


def carried_files(job: Job, remote_prefixes: Sequence[str] = DEFAULT_REMOTE_PREFIXES) -> list[CarriedFile]:
    """The job's files that travel with it, each with a unique place under `user_files/` (its own name, so the
    problem ids it gives are the ones of a local run); SubmitError naming the field of every one that is missing."""
    for prefix in remote_prefixes:
        _prefix_parts(prefix)  # a relative prefix is an error even when no path is under it
    carried: dict[Path, CarriedFile] = {}
    taken: set[str] = set()
    missing = []
    for field, path in job_files(job):
        if is_remote(path, remote_prefixes):
            continue
        source = Path(path).expanduser().resolve()
        if source.is_dir():
            missing.append(
                f"{field}: {path} is a folder, which submit does not carry: put it on every node under a remote "
                "prefix (--remote-prefix), or write it as one Parquet or JSONL file"
            )
            continue
        if not source.is_file():
            missing.append(
                f"{field}: {path} ({source}) is {'not a file' if source.exists() else 'missing'} on this machine"
            )
            continue
        if source in carried:  # one file named twice (task.path and eval.task_path) travels once
            carried[source] = CarriedFile((*carried[source].fields, field), source, carried[source].staged)
            continue
        staged = f"{USER_FILES}/{source.name}"
        copy = 1
        while staged in taken:
            copy += 1
            staged = f"{USER_FILES}/{copy}/{source.name}"
        taken.add(staged)
        carried[source] = CarriedFile((field,), source, staged)
    if missing:
        prefixes = ", ".join(remote_prefixes)
        raise SubmitError(
            "the job names files that submit cannot carry to the cluster:\n  "
            + "\n  ".join(missing)
            + f"\nsubmit uploads the files a job names from this machine (relative paths from "
            f"{Path.cwd()}); for a file on the cluster already, give its absolute path under a remote "
            f"prefix ({prefixes}; add one with --remote-prefix)"
        )
    return list(carried.values())


def with_carried_paths(job: Job, carried: Sequence[CarriedFile]) -> Job:
    """A copy of `job` (validated again) whose fields name the carried files where the driver finds them."""
    staged = {field: file.staged for file in carried for field in file.fields}
    data = job.model_dump(mode="json", by_alias=True)
    if "task.path" in staged:
        data["task"]["path"] = staged["task.path"]
    if "task.reward" in staged:
        data["task"]["reward"] = f"{staged['task.reward']}:{job.task.reward.rpartition(':')[2]}"
    if "eval.task_path" in staged:
        data["eval"]["task_path"] = staged["eval.task_path"]
    for name, values in data["eval"]["sets"].items():
        values["path"] = staged.get(f"eval.sets.{name}.path", values["path"])
    data["environment"]["tools"] = [
        f"{staged[f'environment.tools.{index}']}:{entry.rpartition(':')[2]}"
        if f"environment.tools.{index}" in staged
        else entry
        for index, entry in enumerate(job.environment.tools)
    ]
    try:
        return validate_job(data, "the job with its carried files")
    except JobValidationError as error:  # a bug here, not the user's: their job validated before
        raise SubmitError(str(error)) from None


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB"


def _check_size(destination: Path, carried: Sequence[CarriedFile]) -> None:
    """SubmitError naming the biggest files when the working_dir would be over Ray's upload limit."""
    sizes = [
        (f"{path.relative_to(destination)}", path.stat().st_size) for path in destination.rglob("*") if path.is_file()
    ]
    sizes += [(f"{', '.join(file.fields)} {file.source}", file.source.stat().st_size) for file in carried]
    total, limit = sum(size for _, size in sizes), upload_limit_bytes()
    if total < limit:
        return
    biggest = ", ".join(f"{name} ({_mib(size)})" for name, size in sorted(sizes, key=lambda item: -item[1])[:3])
    raise SubmitError(
        f"the job's working_dir would be {_mib(total)}, over Ray's limit of {_mib(limit)} on an "
        f"uploaded package; the biggest files: {biggest}. Put the big files on storage every node "
        "mounts and give their absolute path under a remote prefix (--remote-prefix; docs/cluster.md, "
        "Shared storage)"
    )


def stage_working_dir(job: Job, destination: Path, remote_prefixes: Sequence[str] = DEFAULT_REMOTE_PREFIXES) -> Path:
    """Copy the project's packages, the files the job names (`carried_files`) and the resolved job, naming them
    where they are now, into `destination` (the job's working_dir). SubmitError, before any file of the job is
    copied, for a file that is missing or a working_dir over Ray's upload limit."""
    carried = carried_files(job, remote_prefixes)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for package in PACKAGES:
        shutil.copytree(PROJECT_ROOT / package, destination / package, ignore=ignore)
    for name in PROJECT_FILES:
        shutil.copy2(PROJECT_ROOT / name, destination / name)
    _check_size(destination, carried)
    for file in carried:
        (destination / file.staged).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(file.source, destination / file.staged)
    (destination / "job.yaml").write_text(dump_job(with_carried_paths(job, carried)))
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


def submit(
    job: Job,
    address: str,
    token: str | None,
    run_dir: str = DEFAULT_RUN_DIR,
    submission_id: str | None = None,
    remote_prefixes: Sequence[str] = DEFAULT_REMOTE_PREFIXES,
) -> Submission:
    """Submit `job` to the cluster, with the files it names; returns at once with the submission id (the run
    keeps going there)."""
    submission_id = submission_id or f"{job.name}-{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"
    cluster_job = for_cluster(job, submission_id, run_dir)
    with tempfile.TemporaryDirectory(prefix="stableasync-submit-") as staging:
        working_dir = stage_working_dir(cluster_job, Path(staging), remote_prefixes)  # before the cluster is asked
        jobs = client(address, token)
        try:
            jobs.submit_job(
                entrypoint=JOB_ENTRYPOINT,
                submission_id=submission_id,
                runtime_env={"working_dir": str(working_dir), "env_vars": stop_env(job)},
                metadata={"stableasync_job": job.name, "stabilizer": job.algorithm.stabilizer.name},
            )
        except Exception as error:
            raise SubmitError(
                f"the cluster at {address} refused job {job.name!r}: {type(error).__name__}: {error}"
            ) from None
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
