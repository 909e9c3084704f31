"""Shared fixtures: tiny models built offline, the environment the real stack needs, the gpu marker."""

from __future__ import annotations

import os

import pytest

from algorithms import native

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ["TORCH_EXTENSIONS_DIR"] = str(native.extensions_dir())  # the cache install.sh built the ops into
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)


def arithmetic_corpus() -> list[str]:
    from itertools import islice

    from tasks.base import build_task
    from tasks.config import ArithmeticConfig

    task = build_task("arithmetic", ArithmeticConfig())
    lines = []
    for problem in islice(task.problems("corpus", 0), 300):
        lines += [problem.question, task.demonstration(problem)]
    return lines


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    from learner.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen2", arithmetic_corpus(), arch="qwen2"))


@pytest.fixture(scope="session")
def tiny_qwen2_tied(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen2 whose output layer and embedding share one weight (as SmolLM2's do)."""
    from learner.models import build_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-qwen2-tied"
    return str(build_tiny_model(path, arithmetic_corpus(), arch="qwen2", tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    from learner.models import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", arithmetic_corpus(), arch="llama"))
