"""A job on several nodes names the field whose path some node does not see, and the nodes."""

from __future__ import annotations

from pathlib import Path

from cluster.run.driver import shared_path_errors


def test_each_path_a_node_misses_is_an_error_on_its_field_naming_the_nodes():
    run_dir, model = Path("/data/runs/job-1"), "/home/me/.cache/stableasync/models/smollm2-135m"
    missing = {"node-b": [str(run_dir), model], "node-c": [model]}
    errors = {error.path: error.message for error in shared_path_errors(run_dir, model, missing)}
    assert set(errors) == {"logging.run_dir", "model.path"}
    assert "node(s) node-b:" in errors["logging.run_dir"] and "node-c" not in errors["logging.run_dir"]
    assert "node-b, node-c" in errors["model.path"] and "STABLEASYNC_CACHE" in errors["model.path"]


def test_nothing_missing_is_no_error():
    assert shared_path_errors(Path("/data/runs/job-1"), "Qwen/Qwen2.5-7B-Instruct", {}) == []
