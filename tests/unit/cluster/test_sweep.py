"""The sweep grid: every cell the same job but for its stabilizer and lag bound; bad cells named up front."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.experiments.sweep import grid
from cluster.job import validate_job

BASE = {
    "name": "base",
    "seed": 7,
    "task": {"name": "arithmetic"},
    "learner": {"steps": 30},
    "algorithm": {"stabilizer": {"name": "tis_seq", "cap": 3.0}},
}


def test_cells_differ_only_in_stabilizer_and_lag(tmp_path):
    cells = grid(validate_job(BASE), ["none", "m2po"], [0, 4], tmp_path, {"learner": {"learning_rate": 1e-3}})
    assert [(c.stabilizer, c.max_lag) for c in cells] == [("none", 0), ("none", 4), ("m2po", 0), ("m2po", 4)]
    assert {c.job.seed for c in cells} == {7}, "same seed: same prompts and initial model"
    assert {c.job.learner.learning_rate for c in cells} == {1e-3} and {c.job.learner.steps for c in cells} == {30}
    assert [c.job.algorithm.stabilizer.name for c in cells] == ["none", "none", "m2po", "m2po"]
    assert cells[3].job.algorithm.stabilizer.tau == 0.04, "each stabilizer with its own defaults"
    assert [c.job.async_.max_lag for c in cells] == [0, 4, 0, 4]
    assert {c.job.logging.run_dir for c in cells} == {str(tmp_path / "runs")}
    assert len({c.job.logging.run_name for c in cells}) == 4


def test_seeds_repeat_the_whole_grid_one_seed_after_another(tmp_path):
    cells = grid(validate_job(BASE), ["none", "m2po"], [0, 4], tmp_path, seeds=[3, 11])
    assert [(c.job.seed, c.stabilizer, c.max_lag) for c in cells] == [
        (3, "none", 0),
        (3, "none", 4),
        (3, "m2po", 0),
        (3, "m2po", 4),
        (11, "none", 0),
        (11, "none", 4),
        (11, "m2po", 0),
        (11, "m2po", 4),
    ]
    assert [c.run_name for c in cells[:2]] == ["none-lag0-seed3", "none-lag4-seed3"]
    assert [c.job.logging.run_name for c in cells] == [c.run_name for c in cells]
    assert len({c.run_name for c in cells}) == 8
    assert {c.job.model.tiny.seed for c in cells} == {0}, "the job seed varies; the initial model stays the same"


def test_fixed_lag_cells_set_the_exact_lag_and_its_bound(tmp_path):
    cells = grid(validate_job(BASE), ["m2po"], [0, 16], tmp_path, fixed_lag=True)
    assert [(c.job.async_.fixed_lag, c.job.async_.max_lag) for c in cells] == [(0, 0), (16, 16)]
    assert [c.run_name for c in cells] == ["m2po-fixed0", "m2po-fixed16"]
    assert {c.job.async_.fixed_lag for c in grid(validate_job(BASE), ["m2po"], [2], tmp_path)} == {None}


def test_a_value_listed_twice_stops_the_sweep_before_anything_runs(tmp_path):
    with pytest.raises(ValueError) as error:
        grid(validate_job(BASE), ["none", "none"], [0, 2], tmp_path, seeds=[1, 2, 1])
    assert str(error.value) == "sweep grid: stabilizer 'none' is listed twice; seed 1 is listed twice"


def test_an_unknown_stabilizer_or_bad_lag_stops_the_sweep_before_anything_runs(tmp_path):
    with pytest.raises(ValueError) as error:
        grid(validate_job(BASE), ["tis_seq", "no_such"], [1, -2], tmp_path)
    text = str(error.value)
    assert "no_such max_lag 1" in text and "tis_seq max_lag -2" in text and "async.max_lag" in text


def test_a_stop_request_ends_the_sweep_while_a_failing_cell_does_not(tmp_path, monkeypatch):
    """A cell that crashes is a finding (failed.txt, the sweep goes on); a Ctrl-C stops the whole sweep."""
    from cluster.experiments.sweep import sweep
    from cluster.run import driver
    from cluster.run.stopping import JobStopped, StopRequest

    ran = []

    def run_job(job, resume_dir=None, stop=None):
        ran.append(job.logging.run_name)
        assert isinstance(stop, StopRequest), "the sweep passes its stop request to every cell"
        if len(ran) == 1:
            raise RuntimeError("a numerical failure")
        raise JobStopped("SIGINT", 3, tmp_path / "checkpoint", tmp_path / "runs" / job.logging.run_name)

    monkeypatch.setattr(driver, "run_job", run_job)
    with pytest.raises(JobStopped):
        sweep(validate_job(BASE), ["none", "m2po"], [0, 4], tmp_path, stop=StopRequest())
    assert ran == ["none-lag0", "none-lag4"], "no cell starts after the stopped one"
    assert (tmp_path / "runs" / "none-lag0" / "failed.txt").exists()
    assert not (tmp_path / "runs" / "none-lag4" / "failed.txt").exists()


def test_a_stopped_sweep_says_so_and_exits_as_the_signal_did(tmp_path, monkeypatch, capsys):
    import json

    from cluster.cli import main
    from cluster.experiments import sweep as sweep_module
    from cluster.run.stopping import JobStopped

    def stopped(*args, **kwargs):
        raise JobStopped(
            "SIGTERM",
            5,
            tmp_path / "runs" / "none-lag0" / "checkpoints" / "step-000005",
            tmp_path / "runs" / "none-lag0",
        )

    monkeypatch.setattr(sweep_module, "sweep", stopped)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(BASE))
    assert main(["sweep", str(job), "--out", str(tmp_path)]) == 143
    err = capsys.readouterr().err
    assert "stopped by SIGTERM after step 5" in err and "the cells after it did not run" in err
    assert f"stableasync train --resume {tmp_path / 'runs' / 'none-lag0'}" in err


def test_seeds_that_are_not_integers_are_named_before_anything_runs(tmp_path, capsys):
    import json

    from cluster.cli import main

    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(BASE))
    assert main(["sweep", str(job), "--out", str(tmp_path), "--seeds", "0,one"]) == 2
    assert "--seeds takes comma-separated integers, not '0,one'" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def _runs_without_the_driver(monkeypatch, out: Path, jobs_seen: list) -> None:
    """Swap the driver for a function that leaves a run directory as run_job does, reward from the cell."""
    import json

    import yaml

    from cluster.run import driver

    def run_job(job, resume_dir=None, stop=None):
        jobs_seen.append(job)
        run_dir = out / "runs" / job.logging.run_name
        run_dir.mkdir(parents=True)
        stabilizer = job.algorithm.stabilizer.name
        (run_dir / "job.yaml").write_text(
            yaml.safe_dump(
                {
                    "name": job.name,
                    "seed": job.seed,
                    "algorithm": {"stabilizer": {"name": stabilizer}},
                    "async": {"max_lag": job.async_.max_lag},
                }
            )
        )
        reward = 0.1 * job.seed + (0.5 if stabilizer == "m2po" else 0.0)
        rows = [{"train/step": step, "time/wall_s": float(step), "rollout/reward_mean": reward} for step in range(1, 4)]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))

    monkeypatch.setattr(driver, "run_job", run_job)


def test_sweep_set_options_change_every_cell_through_the_job_schema(tmp_path, monkeypatch, capsys):
    import json

    from cluster.cli import main

    seen: list = []
    _runs_without_the_driver(monkeypatch, tmp_path / "out", seen)
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(BASE))
    assert (
        main(
            [
                "sweep",
                str(job),
                "--stabilizers",
                "vcpo",
                "--max-lag",
                "0,2",
                "--set",
                "learner.steps=7",
                "--set",
                "learner.learning_rate=0.002",
                "--set",
                "algorithm.loss_aggregation=seq-mean-token-mean",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    assert [(j.learner.steps, j.learner.learning_rate, j.algorithm.loss_aggregation) for j in seen] == [
        (7, 0.002, "seq-mean-token-mean")
    ] * 2
    assert seen[0].algorithm.stabilizer.name == "vcpo" and seen[0].algorithm.stabilizer.cap == 8.0
    assert (
        main(
            [
                "sweep",
                str(job),
                "--stabilizers",
                "vcpo",
                "--max-lag",
                "0",
                "--set",
                "learner.stepz=7",
                "--out",
                str(tmp_path / "bad"),
            ]
        )
        == 2
    )  # a field the schema does not know: refused, nothing runs
    assert "learner.stepz" in capsys.readouterr().err and len(seen) == 2


def test_a_sweep_with_seeds_prints_a_row_per_cell_over_its_seeds(tmp_path, monkeypatch, capsys):
    """The CLI end to end but for the driver: each cell leaves a run directory as run_job does."""
    import json

    from cluster.cli import main

    _runs_without_the_driver(monkeypatch, tmp_path / "out", [])
    job = tmp_path / "job.yaml"
    job.write_text(json.dumps(BASE))
    assert (
        main(
            [
                "sweep",
                str(job),
                "--stabilizers",
                "none,m2po",
                "--max-lag",
                "0,2",
                "--seeds",
                "1,3",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "| none lag 0 seed 1 |" in printed and "| m2po lag 2 seed 3 |" in printed
    cells = printed.split("over seeds")[1]
    assert "| none | 0 | 1,3 | 0/2 | 0.200 | 0.100–0.300 |" in cells  # the terminal's columns
    assert "| m2po | 2 | 1,3 | 0/2 | 0.700 | 0.600–0.800 |" in cells
    assert (tmp_path / "out" / "cells.csv").is_file()
