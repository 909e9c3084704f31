"""`stableasync submit` against a real Ray head on loopback with token authentication.

The head is `ray start --head --block` in its own process group (dashboard and Jobs API bound to
127.0.0.1, RAY_AUTH_MODE=token); the jobs are tiny but real: vLLM generator, DeepSpeed learner, W&B offline.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("ray.dashboard.modules.job.sdk")
pytest.importorskip("aiohttp_cors", reason="the Jobs API needs the ray[default] extra")

import contextlib

from actors.buffer import audit_ledger
from cluster.cli import main as cli_main
from cluster.job import validate_job
from cluster.remote.submit import SubmitError, submit
from tests.unit.cluster.test_metrics import _wandb_records


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def token_head(tmp_path_factory):
    """A head node with token auth; yields (jobs API address, token file). Stopped with its process group."""
    root = tmp_path_factory.mktemp("head")
    token = secrets.token_hex(32)
    token_file = root / "auth_token"
    token_file.write_text(token)
    api, gcs_port = f"http://127.0.0.1:{_free_port()}", _free_port()
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": token,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",  # the job's `python` is this venv's
        "STABLEASYNC_CACHE": str(root / "cache"),
    }
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            "--node-ip-address",
            "127.0.0.1",
            f"--port={gcs_port}",
            "--dashboard-host",
            "127.0.0.1",
            f"--dashboard-port={api.rsplit(':', 1)[1]}",
            "--num-cpus",
            "4",
            "--object-store-memory",
            str(300 << 20),
            "--disable-usage-stats",
        ],
        env=env,
        start_new_session=True,
        stdout=open(root / "head.log", "w"),  # noqa: SIM115 - the process writes it until killed
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for_api(api, token, head, root / "head.log")
        yield api, token_file
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(timeout=15)  # CI saw it take the whole minute: then the group is killed anyway
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
        time.sleep(2)  # let raylet children exit before the next module starts its cluster
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        # A killed head leaves its address in Ray's "current cluster" file, where a later plain
        # ray.init() would look for a cluster to join: remove it if it is this head's.
        current = Path(tempfile.gettempdir()) / "ray" / "ray_current_cluster"
        if current.exists() and current.read_text().strip().endswith(f":{gcs_port}"):
            current.unlink()


def _wait_for_api(api: str, token: str, head: subprocess.Popen, log: Path, timeout_s: float = 120.0) -> None:
    from cluster.remote.submit import client

    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            raise RuntimeError(f"ray start exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            client(api, token).list_jobs()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Jobs API at {api} did not come up:\n{log.read_text()[-3000:]}") from None
            time.sleep(1)


def _job(tmp_path: Path, name: str, stabilizer: dict) -> Path:
    job = {
        "name": name,
        "model": {"path": "tiny", "sft_warmup": {"steps": 2, "prompts_per_step": 8}},
        "task": {"name": "arithmetic"},
        "generator": {
            "num_generators": 1,
            "samples_per_prompt": 4,
            "prompts_per_request": 2,
            "max_new_tokens": 8,
            "max_model_len": 96,
        },
        "learner": {"num_ranks": 1, "steps": 3, "prompts_per_step": 2, "learning_rate": 1e-3},
        "algorithm": {"stabilizer": stabilizer},
        "async": {"max_lag": 1},
        "logging": {"wandb": {"mode": "offline"}, "progress_bar": False},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_a_submission_without_the_token_or_with_a_wrong_one_is_refused(token_head, tmp_path, capsys):
    api, token_file = token_head
    job = validate_job(yaml.safe_load(_job(tmp_path, "refused", {"name": "tis_seq"}).read_text()))
    for token in (None, "not-the-token"):
        with pytest.raises(SubmitError, match=r"Authentication|Forbidden|Unauthorized"):
            submit(job, api, token, run_dir=str(tmp_path / "runs"))
    assert cli_main(["submit", str(tmp_path / "refused.yaml"), "--address", api, "--no-auth"]) == 1
    assert "Authentication" in capsys.readouterr().err
    wrong = tmp_path / "wrong_token"
    wrong.write_text("0" * 64)
    assert cli_main(["status", "anything", "--address", api, "--token-file", str(wrong)]) == 1
    err = capsys.readouterr().err
    assert f"Authentication refused by the Ray cluster at {api}" in err and "is not the cluster's" in err, err
    assert "RAY_AUTH_MODE is currently" not in err  # Ray's note about this machine's own mode misled
    assert not (tmp_path / "runs").exists(), "nothing ran"
    # the right token is accepted by the same API
    assert cli_main(["status", "no-such-job", "--address", api, "--token-file", str(token_file)]) == 1
    assert "no-such-job" in capsys.readouterr().err


def _carried_job(tmp_path: Path) -> tuple[Path, Path]:
    """A dataset job whose files are the user's, outside the repository: its data (every row weighs 0.5) and
    reward module (a row's weight) in `mine/`, named from there, and an evaluation set (rows weigh 0.25) on
    "shared storage" (`shared/`, which the head on this machine sees). Returns the job file and `shared/`."""
    mine, shared = tmp_path / "mine", tmp_path / "shared"
    mine.mkdir()
    shared.mkdir()
    for path, weight in ((mine / "mine.jsonl", 0.5), (shared / "held_out.jsonl", 0.25)):
        path.write_text(
            "".join(
                json.dumps({"prompt": f"What is {n} + 1?", "answer": n + 1, "weight": weight}) + "\n"
                for n in range(1, 5)
            )
        )
    (mine / "mine_reward.py").write_text("def score(completion, answer, row):\n    return row['weight']\n")
    job_file = _job(tmp_path, "carried", {"name": "tis_seq"})
    job = yaml.safe_load(job_file.read_text())
    job["task"] = {"name": "dataset", "path": "mine.jsonl", "reward": "mine_reward.py:score"}  # from mine/
    job["eval"] = {"every_steps": 3, "num_problems": 4, "task_path": str(shared / "held_out.jsonl")}
    job_file.write_text(yaml.safe_dump(job))
    return job_file, shared


def test_a_job_whose_file_is_missing_here_is_not_submitted(token_head, tmp_path, monkeypatch, capsys):
    api, token_file = token_head
    from cluster.remote.submit import client

    job_file, _ = _carried_job(tmp_path)
    monkeypatch.chdir(tmp_path)  # mine.jsonl and mine_reward.py are in mine/, not here
    before = len(client(api, token_file.read_text()).list_jobs())
    assert cli_main(["submit", str(job_file), "--address", api, "--token-file", str(token_file)]) == 1
    err = capsys.readouterr().err
    assert "task.path: mine.jsonl" in err and "task.reward: mine_reward.py" in err and "--remote-prefix" in err
    assert "eval.task_path" not in err, "the evaluation set is here, and carried"
    assert len(client(api, token_file.read_text()).list_jobs()) == before, "nothing was submitted"


@pytest.mark.slow
def test_a_job_runs_on_the_cluster_with_the_files_it_names_here(token_head, tmp_path, monkeypatch, capsys):
    """The data file and reward module travel with the job (relative paths, from the folder submit runs in);
    the evaluation set, under a remote prefix, is read where it is. About a minute."""
    api, token_file = token_head
    from cluster.remote.submit import client, wait

    job_file, shared = _carried_job(tmp_path)
    monkeypatch.chdir(tmp_path / "mine")
    runs = tmp_path / "runs"
    assert (
        cli_main(
            [
                "submit",
                str(job_file),
                "--address",
                api,
                "--token-file",
                str(token_file),
                "--run-dir",
                str(runs),
                "--remote-prefix",
                str(shared),
            ]
        )
        == 0
    )
    submission_id = capsys.readouterr().out.split()[1].rstrip(";")
    token = token_file.read_text()
    status = wait(api, token, submission_id, timeout_s=400)
    assert status == "SUCCEEDED", client(api, token).get_job_logs(submission_id)[-3000:]
    run_dir = runs / submission_id
    ran = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert ran["task"]["path"] == "user_files/mine.jsonl"
    assert ran["task"]["reward"] == "user_files/mine_reward.py:score"
    assert ran["eval"]["task_path"] == str(shared / "held_out.jsonl"), "a remote path is left as it is"
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == [] and sum(r["event"] == "trained" for r in rows) == 3 * 2
    assert {r["problem_id"].rsplit("-", 1)[0] for r in rows if r["event"] == "trained"} == {"mine"}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [m["rollout/reward_mean"] for m in metrics if "rollout/reward_mean" in m]
    assert trained and all(reward == pytest.approx(0.5) for reward in trained), "the user's reward on their rows"
    (evaluation,) = [m for m in metrics if "eval/reward_mean" in m]
    assert evaluation["eval/problems"] == 4 and evaluation["eval/reward_mean"] == pytest.approx(0.25)


# Two whole jobs through the job API take about 2.5 minutes here: run with -m slow, to keep the default
# suite inside its budget; the token checks above stay in the default run.
@pytest.mark.slow
def test_two_jobs_at_once_each_with_its_own_stabilizer_run_dir_and_wandb_run(token_head, tmp_path, capsys):
    api, token_file = token_head
    from cluster.remote.submit import client, wait

    token = token_file.read_text()
    runs = tmp_path / "runs"
    ids = {}
    for name, stabilizer in (("tis", {"name": "tis_seq"}), ("m2po", {"name": "m2po"})):
        assert (
            cli_main(
                [
                    "submit",
                    str(_job(tmp_path, name, stabilizer)),
                    "--address",
                    api,
                    "--token-file",
                    str(token_file),
                    "--run-dir",
                    str(runs),
                ]
            )
            == 0
        )
        out = capsys.readouterr().out
        ids[name] = out.split()[1].rstrip(";")
    statuses = {name: wait(api, token, submission_id, timeout_s=540) for name, submission_id in ids.items()}
    jobs = client(api, token)
    assert statuses == {"tis": "SUCCEEDED", "m2po": "SUCCEEDED"}, {
        name: jobs.get_job_logs(i)[-3000:] for name, i in ids.items()
    }
    for name, stabilizer in (("tis", "tis_seq"), ("m2po", "m2po")):
        run_dir = runs / ids[name]
        assert yaml.safe_load((run_dir / "job.yaml").read_text())["algorithm"]["stabilizer"]["name"] == stabilizer
        rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
        assert audit_ledger(rows) == []
        assert sum(r["event"] == "trained" for r in rows) == 3 * 2
        assert len(list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
    assert cli_main(["status", ids["tis"], "--address", api, "--token-file", str(token_file)]) == 0
    assert "SUCCEEDED" in capsys.readouterr().out
    assert cli_main(["logs", ids["m2po"], "--address", api, "--token-file", str(token_file)]) == 0
    assert "ledger:" in capsys.readouterr().out


@pytest.mark.slow
def test_stop_ends_a_submitted_job_at_a_step_with_a_checkpoint(token_head, tmp_path, capsys):
    """`stableasync stop`: Ray sends the stop signal `submit` chose (SIGINT, as a Ctrl-C) to the job's
    entrypoint and every process under it, and the entrypoint passes it on to the driver alone; the job
    stops at a step boundary with a checkpoint, its metrics, a closed ledger and a whole W&B run (the W&B
    service was not signalled), within the grace period `submit` asked Ray for instead of Ray's 3 s."""
    api, token_file = token_head
    from cluster.remote.submit import client, wait

    job_file = _job(tmp_path, "stopped", {"name": "tis_seq"})
    job = yaml.safe_load(job_file.read_text())
    job["learner"]["steps"] = 200
    job_file.write_text(yaml.safe_dump(job))
    runs = tmp_path / "runs"
    auth = ["--address", api, "--token-file", str(token_file)]
    assert cli_main(["submit", str(job_file), "--run-dir", str(runs), *auth]) == 0
    submission_id = capsys.readouterr().out.split()[1].rstrip(";")
    metrics = runs / submission_id / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (
        metrics.exists() and any(json.loads(line)["train/step"] >= 2 for line in metrics.read_text().splitlines())
    ):
        assert time.monotonic() < deadline, client(api, token_file.read_text()).get_job_logs(submission_id)[-3000:]
        time.sleep(0.2)
    assert cli_main(["stop", submission_id, *auth]) == 0
    assert wait(api, token_file.read_text(), submission_id, timeout_s=120) == "STOPPED"
    logs = client(api, token_file.read_text()).get_job_logs(submission_id)
    assert "stopped by SIGINT after step" in logs, logs[-3000:]
    run_dir = runs / submission_id
    stopped_at = int(logs.split("stopped by SIGINT after step ")[1].split(",")[0])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step-{stopped_at:06d}"]
    rows = [json.loads(line) for line in (run_dir / "ledger.jsonl").read_text().splitlines()]
    assert audit_ledger(rows) == []
    assert sum(r["event"] == "trained" for r in rows) == stopped_at * 2
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["train/step"] for m in metrics if m["train/step"] > 0] == list(range(1, stopped_at + 1))
    (wandb_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    kinds = [record.WhichOneof("record_type") for record in _wandb_records(wandb_file)]
    assert kinds.count("history") == len(metrics) and "exit" in kinds, "the W&B run file was cut short"
