"""The sweep grid: every cell the same job but for its stabilizer and lag bound; bad cells named up front."""

from __future__ import annotations

import pytest

from cluster.job import validate_job
from cluster.sweep import grid

BASE = {"name": "base", "seed": 7, "task": {"name": "arithmetic"}, "learner": {"steps": 30},
        "algorithm": {"stabilizer": {"name": "tis_seq", "cap": 3.0}}}


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


def test_an_unknown_stabilizer_or_bad_lag_stops_the_sweep_before_anything_runs(tmp_path):
    with pytest.raises(ValueError) as error:
        grid(validate_job(BASE), ["tis_seq", "no_such"], [1, -2], tmp_path)
    text = str(error.value)
    assert "no_such max_lag 1" in text and "tis_seq max_lag -2" in text and "async.max_lag" in text
