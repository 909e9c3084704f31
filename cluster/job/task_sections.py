"""The job file's sections of the task's rewards, scoring, tool episodes, sandbox and evaluation sets."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from cluster.job.sections import Section
from tasks.config import TASK_CONFIGS

# The kinds of scoring.rewards components, each with the fields it takes and their defaults (None: required).
# Only a reward model has fields of its own; the other kinds take name and weight alone.
REWARD_KINDS: dict[str, dict[str, Any]] = {
    "task": {},  # the task's own verifier, in the reward workers
    "format": {},  # 1.0 for a completion with an <answer></answer>, else 0.0
    "reward_model": {"path": None, "batch_size": 8, "timeout_s": 60.0, "gpus": 0.0, "max_length": 1024},
}


class RewardSection(Section):
    """One component of a composite reward: the sample's reward is the sum of weight x component."""

    name: Literal[tuple(REWARD_KINDS)] = Field(  # type: ignore[valid-type]
        description="task: the task's verifier; format: 1.0 with an <answer></answer>, else 0.0; reward_model: a "
        "Hugging Face sequence-classification model with one output, scored in a Ray actor"
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="its factor in the sum (negative: a penalty)")
    path: str | None = Field(
        None,
        description="reward_model: a local model folder (config, weights, tokenizer) or a "
        "Hugging Face hub id (downloaded once to the cache)",
    )
    batch_size: int | None = Field(None, gt=0, description="reward_model: texts per forward pass (default 8)")
    timeout_s: float | None = Field(
        None,
        gt=0,
        description="reward_model: seconds one group's scoring may take; "
        "past it the group's samples fail and the actor is replaced (default 60)",
    )
    gpus: float | None = Field(None, ge=0, description="reward_model: GPUs of its actor (default 0: on CPU)")
    max_length: int | None = Field(
        None,
        gt=0,
        description="reward_model: tokens of prompt and completion it reads, cut from the left (default 1024)",
    )

    @model_validator(mode="before")
    @classmethod
    def kind_fields(cls, data: Any) -> Any:
        """Fill in the kind's defaults; refuse a field the kind does not take, or a required one left out."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in REWARD_KINDS:
            return data  # the `name` field reports it
        kind, fields = data["name"], REWARD_KINDS[data["name"]]
        foreign = sorted(
            str(key)
            for key, value in data.items()  # null: as the resolved job writes them
            if key not in {"name", "weight", *fields} and value is not None
        )
        if foreign:
            raise ValueError(
                f"{', '.join(foreign)}: not a field of a {kind!r} reward (its fields: "
                f"{', '.join(['name', 'weight', *fields])})"
            )
        missing = [key for key, default in fields.items() if default is None and data.get(key) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required for a {kind!r} reward")
        return {**{k: v for k, v in fields.items() if v is not None}, **data}


class ScoringSection(Section):
    """Reward workers (`tasks/scoring.py`): each completion is scored in a verifier subprocess, so a verifier
    that raises, hangs or eats memory fails only its own sample."""

    rewards: list[RewardSection] | None = Field(
        None,
        min_length=1,
        description="a composite reward: the sum of weight x each component, each logged as "
        "rollout/reward_<name>_mean; a component that fails a sample fails it (reward 0, the reason in the "
        "ledger). One component per name. None: the task's verifier alone",
    )

    workers: int = Field(1, gt=0, description="verifier subprocesses scoring a group's completions in parallel")
    timeout_s: float = Field(
        5.0,
        gt=0,
        description="seconds one completion may take to score; past it the sample fails (reward 0, a "
        "score error in the ledger) and its worker is replaced",
    )
    memory_limit_mb: int | None = Field(
        4096,
        gt=0,
        description="address space each worker may add to what it holds once its task is built; a "
        "verifier past it fails its sample; null: no limit",
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="seconds a worker may take to import and build the task before the job stops"
    )


class EnvironmentSection(Section):
    """Multi-turn episodes with tools (`tasks/environment.py`): the policy calls tools between its turns; their
    results are context, never trained on. No tools: one turn, the answer."""

    tools: list[str] = Field(
        default_factory=list,
        description="tools the policy may call: built-in names "
        "(calculator, countdown_check) or your own function as 'FILE.py:NAME' or 'module:NAME'",
    )
    max_turns: int = Field(
        4, ge=1, description="policy turns per episode, the answer's included; the episode ends there even mid-call"
    )
    tool_call_format: Literal["hermes"] = Field(
        "hermes",
        description='how a turn writes tool calls: hermes is <tool_call>{"name": ..., "arguments": {...}}</tool_call>',
    )
    tool_timeout_s: float = Field(
        5.0,
        gt=0,
        description="seconds one tool call may run; past it the episode fails "
        "(reason in the ledger) and the tool's worker is replaced",
    )
    tool_memory_limit_mb: int | None = Field(
        1024,
        gt=0,
        description="address space a tool worker may add once started; past it the episode fails; null: no limit",
    )
    max_tool_output_chars: int = Field(
        4096, gt=0, description="characters a tool may return or print; more fails the episode"
    )
    tool_workers: int = Field(
        1, gt=0, description="tool subprocesses per generator, running a round's calls in parallel"
    )
    train_failed_episodes: bool = Field(
        False,
        description="train an episode that failed for its tools' sake (a tool raised, hung, ran out of "
        "memory or printed too much) as a wrong answer at reward 0; false: it is left out of training, the "
        "reason in the ledger (its group is dropped when fewer than two responses are left)",
    )


class SandboxSection(Section):
    """Where untrusted code runs (`tasks/sandbox.py`, docs/security.md): the task's verifier, a user's reward
    function and the tools the policy calls, each call in a process group of its own that a timeout or the end
    of the call kills, with an environment of its own, limits and a private working directory."""

    isolation: Literal["none", "namespaces", "auto"] = Field(
        "auto",
        description="namespaces: network, mount and PID namespaces (unshare): no network, the filesystem "
        "read-only but a private temp dir; refused by `validate` on a machine where they cannot start. none: "
        "process limits alone. auto: namespaces where they start, else none (the worker logs which)",
    )
    env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list,
        description="environment variables passed to the sandbox by name; it gets no "
        "other but PATH and LANG (HOME and TMPDIR are its private directory)",
    )
    cpu_s: float = Field(60.0, gt=0, description="CPU seconds one call may use; past it the call fails")
    max_processes: int = Field(
        64, gt=0, description="processes and threads a sandbox may add (a fork bomb stops there)"
    )
    max_file_mb: int = Field(256, gt=0, description="size of a file a call may write, in MiB")
    max_open_files: int = Field(256, gt=0, description="file descriptors a sandbox may hold open")
    max_output_chars: int = Field(
        65536,
        gt=0,
        description="bytes a verifier or reward function may write to its "
        "stdout and stderr per call; more fails the sample (tools: "
        "environment.max_tool_output_chars)",
    )


# The tasks that read a data file (their config has a `path`): the formats an evaluation set's file may have.
FILE_TASKS = tuple(
    name for name, config in TASK_CONFIGS.items() if "path" in {field.name for field in dataclasses.fields(config)}
)
EVAL_SET_NAME = r"^[A-Za-z0-9_-]+$"  # it becomes part of metric keys (eval/NAME/solved) and of --set paths
DEFAULT_EVAL_SET = "default"  # what `stableasync evaluate` calls the unnamed set of eval.num_problems
# Fields of a set's task config that serve training only: an evaluation set is answered, never demonstrated.
EVAL_SET_TASK_RESETS: dict[str, Any] = {"max_rows": None, "demonstration_field": None}


class EvalSetSection(Section):
    """One named evaluation set: a JSONL file the policy answers at every evaluation, logged as `eval/NAME/*`."""

    path: str = Field(
        description="the set's problems: a JSONL or Parquet file, a dataset folder or hf:OWNER/NAME, as task.path; "
        "a relative path is from the working directory"
    )
    task: Literal[FILE_TASKS] | None = Field(  # type: ignore[valid-type]
        None,
        description="the task format that reads the file and scores its answers: gsm8k (rows {question, "
        "answer: '... #### GOLD'}) or dataset (rows {prompt, answer}, see prompt_field); default: the job's task, "
        "which must read a file",
    )
    split: str | None = Field(
        None,
        description="a folder's or Hub dataset's split (a held-out set is often 'test'); default: the job's "
        "task.split, else 'train'",
    )
    prompt_field: str | None = Field(
        None,
        description="dataset sets: the field with the prompt (default: the job's "
        "task.prompt_field for a dataset job, else 'prompt')",
    )
    answer_field: str | None = Field(
        None,
        description="dataset sets: the field with the gold answer (default: the "
        "job's task.answer_field for a dataset job, else 'answer')",
    )
    num_problems: int | None = Field(
        None,
        gt=0,
        description="problems drawn from the file, a seeded sample that "
        "stays the same at every evaluation; none: every row",
    )
    samples_per_problem: int | None = Field(
        None, gt=0, description="answers per problem, k of pass@k; none: eval.samples_per_problem"
    )
    temperature: float | None = Field(None, ge=0, description="sampling temperature; none: eval.temperature")


class EvalSection(Section):
    """Periodic evaluation: the policy answers one fixed set of problems; `eval/*` metrics at those steps."""

    every_steps: int = Field(0, ge=0, description="evaluate after every N learner steps and the last; 0: never")
    before_training: bool = Field(
        False,
        description="also evaluate the starting policy (after any SFT warm-up) "
        "as step 0, beside the first RL steps: the baseline the run is measured against",
    )
    num_problems: int = Field(64, gt=0, description="size of the fixed evaluation set (fewer if the data has fewer)")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0: greedy")
    samples_per_problem: int = Field(
        1,
        gt=0,
        description="answers per problem (needs temperature > 0 when above "
        "1); eval/solved is then the mean over all answers (avg@k), and "
        "eval/pass_at_k the share of problems with a correct answer among them",
    )
    pass_at: list[int] = Field(
        default_factory=list,
        description="k's of eval/pass_at_K, each estimated without bias from the "
        "samples_per_problem answers of every set (1 - C(n - c, k) / C(n, k) per problem, n answers of which c are "
        "correct; each k at most n), beside eval/pass_at_k (k = n) and eval/maj_at_k",
    )
    task_path: str | None = Field(
        None,
        description="data file of the evaluation set for a task that reads one "
        "(gsm8k: the test split); default: the task's own data, drawn in another order",
    )
    sets: dict[str, EvalSetSection] = Field(
        default_factory=dict,
        description="named evaluation sets answered at the same steps as the set above, "
        "each logged under its own keys eval/NAME/* (docs/tasks.md); names are letters, digits, _ and -",
    )
