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
from cluster.job import Job, JobError, JobValidationError, environment_spec
from learner.lora import missing_target_modules
from learner.models import KNOWN_MODEL_TYPES, KNOWN_MODELS, build_tiny_model, check_chat_template, loadable_model
from learner.records import TrainingSample
from tasks.base import Problem, Task
from tasks.environment import EnvironmentSpec, ToolChat, environment_tools, schema_names
from tasks.tools import tools_prompt

CORPUS_PROBLEMS = 2000


def cache_root() -> Path:
    return Path(os.environ.get("STABLEASYNC_CACHE", Path.home() / ".cache" / "stableasync"))


def prepare_model(job: Job, task: Task) -> str:
    """A local model folder for the job: the tiny model (built once per settings), or a resolved path."""
    if job.model.path != "tiny":
        path = loadable_model(job.model.path)
        check_chat_template(path)
        return path
    tiny = job.model.tiny.model_dump()
    environment = environment_spec(job)
    corpus = task_corpus(task, job.seed, environment)
    key = hashlib.sha256(
        json.dumps(
            {
                "tiny": tiny,
                "task": job.task.model_dump(),
                "corpus": corpus[:50],
                "tools": environment and list(environment.tools),
            },
            sort_keys=True,
        ).encode()
    ).hexdigest()[:12]
    out_dir = cache_root() / "models" / f"tiny-{job.task.name}-{key}"
    build_tiny_model(out_dir, corpus, **tiny)
    return str(out_dir)


def check_model(job: Job) -> None:
    """What `train` refuses about the model before it starts anything, found without loading weights or
    starting Ray (`validate`): a folder that is no model, a hub id not in the cache while the hub cannot be
    reached, LoRA target modules the model does not have."""
    path = job.model.path
    if path not in ("tiny", *KNOWN_MODELS):
        path = loadable_model(path)
    if job.model.lora is None:
        return
    from transformers import AutoConfig

    if path == "tiny":
        check_lora_targets(job, AutoConfig.for_model(job.model.tiny.arch), "the tiny model")
    elif path in KNOWN_MODEL_TYPES:
        check_lora_targets(job, AutoConfig.for_model(KNOWN_MODEL_TYPES[path]), path)
    else:
        check_lora_targets(job, path, path)


def check_lora_targets(job: Job, config: Any, model_name: str) -> None:
    """Refuse LoRA target modules the model (`config`: a transformers config, a folder or a hub id) does not
    have, before any actor starts (peft would only say so in every learner rank)."""
    if job.model.lora is None:
        return
    missing = missing_target_modules(config, tuple(job.model.lora.target_modules))
    if missing:
        raise JobValidationError(
            job.name, [JobError("model.lora.target_modules", f"{missing} name no linear layer of {model_name}")]
        )


def check_tools(job: Job) -> None:
    """Load the job's tools here, as the generators will: TaskError naming the entry of one that does not."""
    environment = environment_spec(job)
    if environment is not None:
        environment_tools(environment)


def task_corpus(task: Task, seed: int, environment: EnvironmentSpec | None = None) -> list[str]:
    """Everything the tiny model reads: the rendered messages (instructions included) and demonstrations, and
    with tools their description and demonstrated episodes.

    Text left out of the tokenizer's corpus is spelled byte by byte, which pushes the operands of
    a question dozens of positions away from the answer and leaves a tiny model unable to use them.
    """
    lines = ["system", "user", "assistant", "tool"]  # the chat template's role names
    schemas = environment_tools(environment) if environment else []
    tools = schema_names(schemas)
    if environment:
        lines.append(tools_prompt(schemas))
    for problem in islice(task.problems("corpus", seed), CORPUS_PROBLEMS):
        lines.extend(message["content"] for message in task.messages(problem))
        lines.append(task.demonstration(problem))
        lines.extend(message["content"] for message in task.tool_demonstration(problem, tools) or [])
    return lines


@lru_cache(maxsize=4)
def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@lru_cache(maxsize=4)
def _tool_chat(model_path: str, environment: EnvironmentSpec) -> ToolChat:
    """Built once per run, not at every warm-up step: it loads the tools and probes the chat template."""
    return ToolChat(_tokenizer(model_path), environment_tools(environment))


def sft_samples(
    model_path: str, task: Task, problems: list[Problem], environment: EnvironmentSpec | None = None
) -> list[TrainingSample]:
    """Training samples whose completion is the task's demonstration followed by end-of-turn; with tools, its
    demonstrated episode where it has one within `max_turns` (the tools' results masked out, as in RL)."""
    tokenizer = _tokenizer(model_path)
    chat = _tool_chat(model_path, environment) if environment else None
    samples = []
    for group_id, problem in enumerate(problems):
        messages = task.messages(problem)
        prompt = chat.prompt_ids(messages) if chat else chat_prompt_ids(tokenizer, messages)
        episode = _demonstrated_episode(task, problem, environment, chat)
        completion = (
            episode[0]
            if episode
            else ([*tokenizer.encode(task.demonstration(problem), add_special_tokens=False), tokenizer.eos_token_id])
        )
        sample = TrainingSample(
            prompt_ids=prompt,
            completion_ids=completion,
            reward=0.0,
            group_id=group_id,
            behaviour_logprobs=[0.0] * len(completion),
            version=0,
        )
        if episode:
            sample["policy_mask"] = episode[1]
        samples.append(sample)
    return samples


def _demonstrated_episode(
    task: Task, problem: Problem, environment: EnvironmentSpec | None, chat: ToolChat | None
) -> tuple[list[int], list[int]] | None:
    """The task's demonstrated episode with the job's tools as completion ids and policy mask, or None when it has
    none or it takes more than `max_turns`."""
    if environment is None or chat is None:
        return None
    episode = task.tool_demonstration(problem, chat.tool_names)
    if not episode or sum(message["role"] == "assistant" for message in episode) > environment.max_turns:
        return None
    return chat.demonstration(episode)
