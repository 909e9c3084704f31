"""The trained model folder is written aside and renamed: a `model` folder is never half-written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.checkpoints import MODEL, write_model


def _save(files: dict[str, str]):
    def save(folder: str) -> None:
        Path(folder).mkdir()
        for name, text in files.items():
            (Path(folder) / name).write_text(text)
    return save


def test_the_model_folder_appears_whole_and_replaces_an_older_one(tmp_path):
    assert write_model(tmp_path, _save({"config.json": "first", "old.bin": "x"})) == tmp_path / MODEL
    write_model(tmp_path, _save({"config.json": "second"}))
    assert sorted(p.name for p in (tmp_path / MODEL).iterdir()) == ["config.json"]
    assert (tmp_path / MODEL / "config.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]  # no partial folder left


def test_a_save_that_fails_leaves_the_previous_model_in_place(tmp_path):
    write_model(tmp_path, _save({"config.json": "first"}))

    def failing(folder: str) -> None:
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_model(tmp_path, failing)
    assert (tmp_path / MODEL / "config.json").read_text() == "first"
    write_model(tmp_path, _save({"config.json": "second"}))  # a later save clears the partial folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]
