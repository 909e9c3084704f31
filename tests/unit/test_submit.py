"""Job submission without a cluster: where the token comes from, what the cluster runs, what is packed."""

from __future__ import annotations

import pytest
import yaml

from cluster.job import load_job, validate_job
from cluster.remote.submit import (PACKAGES, SubmitError, auth_headers, find_token, for_cluster, stage_working_dir,
                                   stop_env)

JOB = {"name": "j", "task": {"name": "arithmetic"}, "cluster": {"address": "127.0.0.1:6379", "num_cpus": 2},
       "algorithm": {"stabilizer": {"name": "m2po"}}}


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
