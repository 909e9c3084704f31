"""Checkpoints and the trained model folder are written aside and renamed: neither is ever half-written."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.run.checkpoints import (
    CHECKPOINTS,
    MODEL,
    CheckpointFailed,
    ModelSaveFailed,
    readable_checkpoints,
    restore_learners,
    write_checkpoint,
    write_model,
)
from cluster.run.state import DriverState


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

    with pytest.raises(ModelSaveFailed, match=rf"could not be written to {tmp_path / MODEL}: OSError: .*No space left"):
        write_model(tmp_path / MODEL, failing)
    assert (tmp_path / MODEL / "config.json").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]  # the partial folder is gone: its space is back
    write_model(tmp_path / MODEL, _save({"config.json": "second"}))  # a later save clears the partial folder
    assert sorted(p.name for p in tmp_path.iterdir()) == [MODEL]


def test_a_checkpoint_that_cannot_be_written_leaves_nothing_and_says_which_step(tmp_path):
    def save_learners(directory: str, tag: str) -> None:
        Path(directory).mkdir()
        (Path(directory) / "shard").write_text("half")
        raise OSError(28, "No space left on device")

    state = DriverState(
        version=7,
        next_group_id=0,
        problems_drawn=0,
        rng=[],
        ready=[],
        in_flight=[],
        rewards=[],
        restarts=[],
        ledger_lines=0,
        metrics_lines=0,
    )
    with pytest.raises(CheckpointFailed, match=r"step 7 could not be written .*OSError.*No space left on device"):
        write_checkpoint(tmp_path, 7, keep=2, save_learners=save_learners, driver_state=state)
    assert list((tmp_path / CHECKPOINTS).iterdir()) == []  # the partial folder is gone: its space is back
    assert readable_checkpoints(tmp_path) == []


def test_train_exits_1_when_the_finished_run_has_no_model(tmp_path, monkeypatch, capsys):
    """Every step ran but the model the user asked for is missing: not a success (exit 1), and why is said."""
    from cluster.cli import main as cli_main
    from cluster.run import driver

    job = tmp_path / "job.yaml"
    job.write_text("task: {name: arithmetic}\n")
    result = driver.RunResult(tmp_path / "run", 3, {"trained": 6}, model_error="the model could not be written")
    monkeypatch.setattr(driver, "run_job", lambda *args: result)
    assert cli_main(["train", str(job)]) == 1
    captured = capsys.readouterr()
    assert "stableasync train: the run finished, but the model could not be written" in captured.err
    assert f"run directory: {tmp_path / 'run'}" in captured.out
    monkeypatch.setattr(driver, "run_job", lambda *args: driver.RunResult(tmp_path / "run", 3, {"trained": 6}))
    assert cli_main(["train", str(job)]) == 0


FULL_DISK = """
import json, resource, signal, sys
import torch
from safetensors.torch import save_file
from learner.checkpoint import storage_errors

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails (EFBIG) instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
weights = {"weight": torch.zeros(100_000)}
writers = {"torch.save": lambda: torch.save(weights, sys.argv[1] + "/a.pt"),
           "safetensors": lambda: save_file(weights, sys.argv[1] + "/a.safetensors")}
seen = {}
for name, write in writers.items():
    try:
        write()
        raw = "no error"
    except Exception as error:
        raw = type(error).__name__
    try:
        with storage_errors(name):
            write()
        wrapped = "no error"
    except OSError as error:
        wrapped = str(error)
    seen[name] = [raw, wrapped]
print(json.dumps(seen))
"""


def test_a_full_disk_under_torch_save_and_safetensors_is_an_oserror(tmp_path):
    """A real failing write (a file-size limit, as a full disk fails it): torch.save raises RuntimeError and
    safetensors SafetensorError, which the driver's OSError handling would miss; `storage_errors`, around
    every checkpoint and model write of the learner and of export, turns them into OSError."""
    import json
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["torch.save"][0] == "RuntimeError" and seen["safetensors"][0] == "SafetensorError"
    for name, (_, wrapped) in seen.items():
        assert wrapped.startswith(f"writing {name} failed: "), wrapped


class _GroupBroke(RuntimeError):
    pass


def test_restore_takes_the_newest_checkpoint_that_loads_but_stops_at_a_fatal_error(tmp_path):
    """A checkpoint that fails to load is passed over for an older one; an error of a fatal kind (the ranks can
    load nothing more) is raised at once, and no older checkpoint is tried on those ranks."""
    candidates = [(tmp_path / f"step-00000{n}", {"version": n}) for n in (3, 2, 1)]
    tried = []

    def load(directory: str, tag: str) -> int:
        tried.append(Path(directory).parent.name)
        if tried[-1] == "step-000003":
            raise RuntimeError("PytorchStreamReader failed reading zip archive")
        if tried[-1] == "step-000002" and broken:
            raise _GroupBroke("learner rank 1 failed in load_checkpoint")
        return 2

    broken = False
    assert restore_learners(load, candidates, fatal=(_GroupBroke,)) == candidates[1]
    assert tried == ["step-000003", "step-000002"]

    broken, tried = True, []
    with pytest.raises(_GroupBroke, match="rank 1 failed in load_checkpoint"):
        restore_learners(load, candidates, fatal=(_GroupBroke,))
    assert tried == ["step-000003", "step-000002"], "nothing older is tried once the group broke"
    tried = []
    assert restore_learners(load, candidates) == candidates[2], "without it, a group error is that checkpoint's"


def test_the_driver_state_reads_back_what_it_wrote_and_names_what_an_old_or_damaged_one_lacks():
    """driver.json round-trips through JSON as typed records (a buffered group's version spans too); a
    checkpoint from before samples were logged still reads (nothing to cut); one that lacks a key every
    checkpoint has is refused naming the key."""
    import json
    import random

    from actors.buffer import ScoredGroup
    from actors.generator import GenerationRequest
    from cluster.run.state import InFlight, UnreadableState
    from cluster.run.step_rows import version_mix
    from tasks.base import Problem

    rng = random.Random(3)
    rng.random()
    # a streaming generator's response: tokens 0-2 sampled by version 2, tokens 3-4 by version 3
    response = {"reward": 1.0, "completion_ids": [7] * 5, "version_spans": [[2, 0, 3], [3, 3, 5]]}
    group = ScoredGroup(4, "p4", [1, 2], [response], 2, 3, 0, "1+1?", "2")
    in_flight = InFlight(
        GenerationRequest(5, "p5", [{"role": "user", "content": "2+2?"}], 11), Problem("p5", "2+2?", "4")
    )
    state = DriverState(
        version=3,
        next_group_id=6,
        problems_drawn=6,
        rng=DriverState.rng_state(rng),
        ready=[group],
        in_flight=[in_flight],
        rewards=[0.5],
        restarts=[(0, 1)],
        ledger_lines=9,
        metrics_lines=4,
        samples_lines=2,
        evaluating=[3],
    )
    back = DriverState.from_json(json.loads(json.dumps(state.to_json())))
    assert back == state
    # the resumed step counts each token's lag from the version that sampled it
    assert version_mix(back.ready, 4) == {"async/token_lag": [0, 2, 3], "async/mixed_version_share": 1.0}
    again = random.Random()
    back.restore_rng(again)
    assert again.random() == rng.random()
    old = state.to_json()
    del old["samples_lines"], old["evaluating"]
    assert DriverState.from_json(old).samples_lines is None
    del old["ledger_lines"]
    with pytest.raises(UnreadableState, match=r"lacks \['ledger_lines'\]"):
        DriverState.from_json(old)


def test_export_of_a_run_without_checkpoints_gives_its_finished_model_or_says_what_to_set(tmp_path, capsys):
    """checkpoint.every_steps defaults to 0, so a finished run has no checkpoint; `export` used to fail with
    'no usable checkpoint' and name neither that setting nor RUN_DIR/model, the trained model it already has."""
    from cluster.cli import main as cli_main

    run = tmp_path / "run"
    run.mkdir()
    (run / "job.yaml").write_text("task: {name: arithmetic}\n")
    assert cli_main(["export", str(run)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.every_steps 0: none are written" in err and f"no finished model at {run / 'model'}" in err
    (run / "model").mkdir()
    (run / "model" / "config.json").write_text("{}")
    (run / "model" / "model.safetensors").write_bytes(b"weights")
    assert cli_main(["export", str(run)]) == 0
    assert str(run / "model") in capsys.readouterr().out
    out = tmp_path / "exported"
    assert cli_main(["export", str(run), "--out", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == b"weights" and str(out) in capsys.readouterr().out
    assert cli_main(["export", str(run), "--out", str(out)]) == 1  # an existing folder is not overwritten
    assert "exported" in capsys.readouterr().err


def test_a_written_model_folder_gives_every_file_the_config_files_mode(tmp_path):
    """The weights came out 0600 beside a 0644 config.json, so a model shared from a run directory had
    unreadable weights."""
    import os

    from cluster.run.checkpoints import write_model

    def save(folder: str) -> None:
        Path(folder).mkdir()
        (Path(folder) / "config.json").write_text("{}")
        os.chmod(Path(folder) / "config.json", 0o644)
        os.close(os.open(Path(folder) / "model.safetensors", os.O_CREAT | os.O_WRONLY, 0o600))

    model = write_model(tmp_path / "model", save)
    assert {p.name: p.stat().st_mode & 0o777 for p in model.iterdir()} == {
        "config.json": 0o644,
        "model.safetensors": 0o644,
    }


def test_export_to_the_hub_where_it_cannot_be_reached_fails_at_once_and_keeps_the_folder(tmp_path, monkeypatch, capsys):
    """`export --push-to-hub REPO` (TRL's push_to_hub): offline, it says so and where the model is, exit 1,
    without the hub client's retries."""
    import time

    from cluster.cli import main as cli_main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    run = tmp_path / "run"
    (run / "model").mkdir(parents=True)
    (run / "job.yaml").write_text("task: {name: arithmetic}\n")
    (run / "model" / "config.json").write_text("{}")
    out = tmp_path / "exported"
    started = time.monotonic()
    assert cli_main(["export", str(run), "--out", str(out), "--push-to-hub", "me/tiny-policy"]) == 1
    assert time.monotonic() - started < 10
    err = capsys.readouterr().err
    assert "the Hugging Face hub cannot be reached from here" in err and "me/tiny-policy was not pushed" in err
    assert f"the model is in {out}" in err and (out / "config.json").is_file()
