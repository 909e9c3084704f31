"""Resolve the job's model to a local folder, building the tiny model from the task's text if asked."""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

from actors.generator import chat_prompt_ids
from actors.records import TrainingSample
from cluster.job import Job
from learner.models import build_tiny_model, check_chat_template, resolve_model
from tasks.base import Problem, Task

CORPUS_PROBLEMS = 2000


def cache_root() -> Path:
    return Path(os.environ.get("STABLEASYNC_CACHE", Path.home() / ".cache" / "stableasync"))


def prepare_model(job: Job, task: Task) -> str:
    """A local model folder for the job: the tiny model (built once per settings), or a resolved path."""
    if job.model.path != "tiny":
        path = resolve_model(job.model.path)
        check_chat_template(path)
        return path
    tiny = job.model.tiny.model_dump()
    corpus = task_corpus(task, job.seed)
    key = hashlib.sha256(json.dumps({"tiny": tiny, "task": job.task.model_dump(), "corpus": corpus[:50]},
                                    sort_keys=True).encode()).hexdigest()[:12]
    out_dir = cache_root() / "models" / f"tiny-{job.task.name}-{key}"
    build_tiny_model(out_dir, corpus, **tiny)
    return str(out_dir)


def task_corpus(task: Task, seed: int) -> list[str]:
    """Everything the tiny model reads: the rendered messages (instructions included) and demonstrations.

    Text left out of the tokenizer's corpus is spelled byte by byte, which pushes the operands of
    a question dozens of positions away from the answer and leaves a tiny model unable to use them.
    """
    lines = ["system", "user", "assistant"]  # the chat template's role names
    for problem in islice(task.problems("corpus", seed), CORPUS_PROBLEMS):
        lines.extend(message["content"] for message in task.messages(problem))
        lines.append(task.demonstration(problem))
    return lines


@lru_cache(maxsize=4)
def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def sft_samples(model_path: str, task: Task, problems: list[Problem]) -> list[TrainingSample]:
    """Training samples whose completion is the task's demonstration followed by end-of-turn."""
    tokenizer = _tokenizer(model_path)
    samples = []
    for group_id, problem in enumerate(problems):
        completion = tokenizer.encode(task.demonstration(problem), add_special_tokens=False) + [tokenizer.eos_token_id]
        samples.append(TrainingSample(prompt_ids=chat_prompt_ids(tokenizer, task.messages(problem)),
                                      completion_ids=completion, behaviour_logprobs=[0.0] * len(completion),
                                      reward=0.0, group_id=group_id, version=0))
    return samples
