"""Checkpoints are unpickled on load, so one that another user owns or can write is refused."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("deepspeed")

from learner.checkpoint import check_owned_by_me


def _checkpoint(tmp_path):
    folder = tmp_path / "state"
    (folder / "sub").mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(b"x")
    (folder / "sub" / "optim.pt").write_bytes(b"y")
    return folder


def test_a_checkpoint_of_ones_own_loads(tmp_path):
    check_owned_by_me(_checkpoint(tmp_path))


def test_a_file_another_user_owns_is_refused(tmp_path):
    folder = _checkpoint(tmp_path)
    try:
        os.chown(folder / "sub" / "optim.pt", os.getuid() + 4242, -1)
    except PermissionError:
        pytest.skip("handing a file to another user needs root")
    with pytest.raises(PermissionError, match=r"optim.pt belongs to another user"):
        check_owned_by_me(folder)


def test_a_world_writable_file_is_refused(tmp_path):
    folder = _checkpoint(tmp_path)
    os.chmod(folder / "mp_rank_00_model_states.pt", 0o666)
    with pytest.raises(PermissionError, match="writable by every user"):
        check_owned_by_me(folder)
