"""Checkpoints and the trained model folder are written aside and renamed: neither is ever half-written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.checkpoints import (CHECKPOINTS, MODEL, CheckpointFailed, readable_checkpoints, write_checkpoint,
                                 write_model)


def _save(files: dict[str, str]):
    def save(folder: str) -> None:
        Path(folder).mkdir()
        for name, text in files.items():
            (Path(folder) / name).write_text(text)
    return save


def test_the_model_folder_appears_whole_and_replaces_an_older_one(tmp_path):
    assert write_model(tmp_path / MODEL, _save({"config.json": "first", "old.bin": "x"})) == tmp_path / MODEL
    write_model(tmp_path / MODEL, _save({"config.json": "second"}))
    assert sorted(p.name for p in (tmp_path / MODEL).iterdir()) == ["config.json"]
    assert (tmp_path / MODEL / "config.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]  # no partial folder left


def test_a_save_that_fails_leaves_the_previous_model_in_place(tmp_path):
    write_model(tmp_path / MODEL, _save({"config.json": "first"}))

    def failing(folder: str) -> None:
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_model(tmp_path / MODEL, failing)
    assert (tmp_path / MODEL / "config.json").read_text() == "first"
    write_model(tmp_path / MODEL, _save({"config.json": "second"}))  # a later save clears the partial folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_and_says_which_step(tmp_path):
    def save_learners(directory: str, tag: str) -> None:
        Path(directory).mkdir()
        (Path(directory) / "shard").write_text("half")
        raise OSError(28, "No space left on device")

    state = {"version": 7}
    with pytest.raises(CheckpointFailed, match=r"step 7 could not be written .*OSError.*No space left on device"):
        write_checkpoint(tmp_path, 7, keep=2, save_learners=save_learners, driver_state=state)
    assert list((tmp_path / CHECKPOINTS).iterdir()) == []  # the partial folder is gone: its space is back
    assert readable_checkpoints(tmp_path) == []
