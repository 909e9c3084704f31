"""Hugging Face hub ids where a model folder is asked for (a reward model's path, `stableasync evaluate`), as
transformers and vLLM take them: from the Hugging Face cache without the network once downloaded, and offline an
error naming the id and the setting. The cache here is a real one in the hub's layout, filled by hand (no network)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def _cache_model(cache: Path, repo_id: str, folder: str) -> Path:
    """`folder`'s files as the hub cache holds a downloaded snapshot of `repo_id`."""
    repo = cache / "hub" / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache / "hub"))
    return cache


def test_evaluate_takes_a_cached_hub_id_and_names_an_uncached_one(tiny_qwen2, offline_cache):
    from cluster.run.evaluation import SavedModelError, saved_model_folder

    snapshot = _cache_model(offline_cache, "someone/tiny-policy", tiny_qwen2)
    assert saved_model_folder(Path("someone/tiny-policy")) == snapshot
    with pytest.raises(SavedModelError) as raised:
        saved_model_folder(Path("someone/not-downloaded"))
    message = str(raised.value)
    assert "MODEL_OR_RUN: 'someone/not-downloaded' is no local folder" in message and "HF_HUB_OFFLINE=1" in message


def test_a_reward_model_may_be_a_cached_hub_id(tiny_qwen2, offline_cache, tmp_path):
    from tasks.rewards import reward_model_problem

    from .test_composite_rewards import build_tiny_reward_model

    folder = build_tiny_reward_model(tiny_qwen2, tmp_path / "reward-model")
    _cache_model(offline_cache, "someone/tiny-reward", folder)
    assert reward_model_problem("someone/tiny-reward") is None
    problem = reward_model_problem("someone/not-downloaded")
    assert problem is not None and "is no local folder and does not load as a Hugging Face hub id" in problem
    assert "HF_HUB_OFFLINE=1" in problem
    assert "no such folder" in reward_model_problem(str(tmp_path / "missing"))
