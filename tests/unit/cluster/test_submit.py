"""Job submission without a cluster: where the token comes from, what the cluster runs, what is packed."""

from __future__ import annotations

import pytest
import yaml

from cluster.job import load_job, validate_job
from cluster.remote.submit import (
    DEFAULT_REMOTE_PREFIXES,
    PACKAGES,
    USER_FILES,
    SubmitError,
    auth_headers,
    carried_files,
    find_token,
    for_cluster,
    is_remote,
    stage_working_dir,
    stop_env,
    upload_limit_bytes,
)

JOB = {
    "name": "j",
    "task": {"name": "arithmetic"},
    "cluster": {"address": "127.0.0.1:6379", "num_cpus": 2},
    "algorithm": {"stabilizer": {"name": "m2po"}},
}


def test_the_token_comes_from_the_first_place_that_has_one(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN_PATH", raising=False)
    with pytest.raises(SubmitError, match=r"RAY_AUTH_TOKEN.*auth_token"):
        find_token()
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert find_token() == "from-home"
    path_file = tmp_path / "elsewhere"
    path_file.write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path_file))
    assert find_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert find_token() == "from-env"
    explicit = tmp_path / "explicit"
    explicit.write_text("from-flag")
    assert find_token(str(explicit)) == "from-flag"
    with pytest.raises(SubmitError, match="--token-file"):
        find_token(str(tmp_path / "missing"))
    assert auth_headers("t") == {"Authorization": "Bearer t"} and auth_headers(None) == {}


def test_the_cluster_runs_the_job_in_its_own_run_dir_on_the_cluster_it_was_sent_to():
    job = for_cluster(validate_job(JOB), "j-20261123-abc", "~/runs")
    assert job.logging.run_dir == "~/runs" and job.logging.run_name == "j-20261123-abc"
    assert job.cluster.address is None and job.cluster.num_cpus is None
    assert job.algorithm.stabilizer.name == "m2po"


def test_the_working_dir_holds_the_packages_and_the_resolved_job(tmp_path):
    job = for_cluster(validate_job(JOB), "sub-1", "/runs")
    staged = stage_working_dir(job, tmp_path / "wd")
    assert {p.name for p in staged.iterdir()} == {*PACKAGES, "pyproject.toml", "job.yaml"}
    assert not list(staged.rglob("__pycache__"))
    assert yaml.safe_load((staged / "job.yaml").read_text())["logging"]["run_name"] == "sub-1"
    assert load_job(staged / "job.yaml") == job


def test_stop_signals_the_job_as_ctrl_c_would_and_waits_the_jobs_grace_period():
    assert stop_env(validate_job(JOB)) == {"RAY_JOB_STOP_SIGNAL": "SIGINT", "RAY_JOB_STOP_WAIT_TIME_S": "300"}
    slow_to_save = validate_job({**JOB, "checkpoint": {"stop_grace_s": 1200}})
    assert stop_env(slow_to_save)["RAY_JOB_STOP_WAIT_TIME_S"] == "1200"


def _dataset_job(tmp_path, **task) -> dict:
    return {**JOB, "task": {"name": "dataset", **task}}


def _user_files(tmp_path):
    """A data file and a reward module in a folder of the user's, outside the repository."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "rows.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n')
    (mine / "reward.py").write_text("def score(completion, answer, row):\n    return 1.0\n")
    return mine


def test_the_files_the_job_names_travel_with_it_and_the_job_names_them_there(tmp_path, monkeypatch):
    mine = _user_files(tmp_path)
    monkeypatch.chdir(mine)  # a relative path is the user's, from where they submit
    other = tmp_path / "other"
    other.mkdir()
    (other / "rows.jsonl").write_text('{"prompt": "What is 2 + 2?", "answer": 4}\n')  # same name, another file
    job = validate_job(
        {
            **_dataset_job(tmp_path, path=str(mine / "rows.jsonl"), reward="reward.py:score"),
            "eval": {"task_path": str(other / "rows.jsonl")},
        }
    )
    before = job.model_dump()
    staged = stage_working_dir(job, tmp_path / "wd")
    assert job.model_dump() == before, "the validated job is not changed"
    sent = load_job(staged / "job.yaml")
    assert (sent.task.path, sent.task.reward, sent.eval.task_path) == (
        "user_files/rows.jsonl",
        "user_files/reward.py:score",
        "user_files/2/rows.jsonl",
    )
    assert (staged / "user_files/rows.jsonl").read_text() == (mine / "rows.jsonl").read_text()
    assert (staged / "user_files/2/rows.jsonl").read_text() == (other / "rows.jsonl").read_text()
    assert (staged / "user_files/reward.py").read_text() == (mine / "reward.py").read_text()
    assert sent.model_dump(exclude={"task", "eval"}) == job.model_dump(exclude={"task", "eval"})
    # the driver runs in the working_dir: there the job builds its task from the carried files
    from cluster.job import evaluation_set, job_task

    monkeypatch.chdir(staged)
    task = job_task(sent)
    assert next(task.problems("train", 0)).answer == "2"
    assert (
        evaluation_set(sent.model_copy(update={"eval": sent.eval.model_copy(update={"every_steps": 1})}), task)[0][
            0
        ].answer
        == "4"
    )


def test_one_file_named_twice_travels_once(tmp_path):
    mine = _user_files(tmp_path)
    job = validate_job(
        {**_dataset_job(tmp_path, path=str(mine / "rows.jsonl")), "eval": {"task_path": str(mine / "rows.jsonl")}}
    )
    (carried,) = carried_files(job)
    assert carried.fields == ("task.path", "eval.task_path") and carried.staged == "user_files/rows.jsonl"
    sent = load_job(stage_working_dir(job, tmp_path / "wd") / "job.yaml")
    assert sent.task.path == sent.eval.task_path == "user_files/rows.jsonl"
    assert sent.task.reward == "math", "a built-in reward names no file"


def test_paths_under_a_remote_prefix_and_module_rewards_stay_as_they_are(tmp_path):
    job = validate_job(
        {
            **_dataset_job(tmp_path, path="/mnt/shared/data/rows.jsonl", reward="my_rewards:score"),
            "eval": {"task_path": "~/stableasync/tasks/data/gsm8k/test.jsonl"},
        }
    )
    assert carried_files(job) == []
    sent = load_job(stage_working_dir(job, tmp_path / "wd") / "job.yaml")
    assert sent == job and not (tmp_path / "wd" / USER_FILES).exists()
    data = tmp_path / "data" / "rows.jsonl"  # not on this machine: on the cluster, under a prefix given
    job = validate_job(_dataset_job(tmp_path, path=str(data)))
    assert carried_files(job, (*DEFAULT_REMOTE_PREFIXES, str(tmp_path / "data"))) == []
    assert is_remote("/mnt/shared/x") and not is_remote("/mnt/sharedx/y") and not is_remote("/mnt/shared/../etc/x")
    assert not is_remote("mnt/shared/x") and not is_remote("~/elsewhere/x") and is_remote("~/stableasync/x")
    with pytest.raises(SubmitError, match="'data' must be an absolute path"):
        carried_files(job, ("data",))


def test_a_missing_file_is_an_error_naming_each_field_before_anything_is_staged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    job = validate_job(
        {**_dataset_job(tmp_path, path="nope.jsonl", reward="gone.py:score"), "eval": {"task_path": str(tmp_path)}}
    )
    with pytest.raises(SubmitError) as error:
        stage_working_dir(job, tmp_path / "wd")
    message = str(error.value)
    assert f"task.path: nope.jsonl ({tmp_path / 'nope.jsonl'}) is missing on this machine" in message
    assert "task.reward: gone.py" in message
    assert f"eval.task_path: {tmp_path} is a folder, which submit does not carry: put it on every node" in message
    assert "--remote-prefix" in message and "/mnt/shared" in message
    assert not (tmp_path / "wd").exists(), "nothing was staged"


def test_a_working_dir_over_rays_upload_limit_is_an_error_naming_the_biggest_files(tmp_path, monkeypatch):
    from ray._private.runtime_env import packaging

    mine = _user_files(tmp_path)
    (mine / "rows.jsonl").write_text('{"prompt": "What is 1 + 1?", "answer": 2}\n' * 250_000)  # 10.0 MiB
    job = validate_job(_dataset_job(tmp_path, path=str(mine / "rows.jsonl")))
    assert upload_limit_bytes() == packaging.GCS_STORAGE_MAX_SIZE == 512 << 20
    stage_working_dir(job, tmp_path / "fits")
    monkeypatch.setattr(packaging, "GCS_STORAGE_MAX_SIZE", 8 << 20)
    with pytest.raises(SubmitError) as error:
        stage_working_dir(job, tmp_path / "too-big")
    message = str(error.value)
    assert "over Ray's limit of 8.0 MiB" in message
    assert f"the biggest files: task.path {mine / 'rows.jsonl'} (10.0 MiB), tasks/data/gsm8k/" in message
    assert "absolute path under a remote prefix" in message
    assert not (tmp_path / "too-big" / USER_FILES).exists(), "the big file was not copied"


def test_a_tools_file_travels_and_built_in_and_remote_tools_stay(tmp_path, monkeypatch):
    mine = _user_files(tmp_path)
    (mine / "my_tools.py").write_text('def lookup(term: str) -> str:\n    """Look it up."""\n    return term\n')
    monkeypatch.chdir(mine)
    tools = ["calculator", "my_tools.py:lookup", "/mnt/shared/tools.py:search"]
    job = validate_job({**_dataset_job(tmp_path, path="rows.jsonl"), "environment": {"tools": tools}})
    staged = stage_working_dir(job, tmp_path / "wd")
    sent = load_job(staged / "job.yaml")
    assert sent.environment.tools == ["calculator", "user_files/my_tools.py:lookup", "/mnt/shared/tools.py:search"]
    assert (staged / "user_files/my_tools.py").read_text() == (mine / "my_tools.py").read_text()
    monkeypatch.chdir(staged)  # the driver's cwd: the carried entry loads there
    from tasks.tools import load_tools

    assert load_tools(sent.environment.tools[:2])["lookup"]("x") == "x"


def test_a_hub_dataset_is_read_on_the_cluster_and_travels_as_its_name(tmp_path):
    job = validate_job(
        {
            **_dataset_job(tmp_path, path="hf:openai/gsm8k", subset="main"),
            "eval": {"task_path": "hf:openai/gsm8k", "sets": {"held": {"path": "hf:openai/gsm8k", "split": "test"}}},
        }
    )
    assert carried_files(job) == []
    sent = load_job(stage_working_dir(job, tmp_path / "wd") / "job.yaml")
    assert sent.task.path == sent.eval.task_path == sent.eval.sets["held"].path == "hf:openai/gsm8k"
    assert sent.eval.sets["held"].split == "test"
