"""The job file: pydantic models with `extra="forbid"`, every error reported at once with its path.

Imports no torch, ray or vllm, so `stableasync validate` runs anywhere in milliseconds. The stabilizer
and task sections are generated from the stdlib config dataclasses in `algorithms/config.py` and
`tasks/config.py`, so defaults and field docs have one source.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import re
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, model_validator

from algorithms.config import STABILIZER_CONFIGS, KLEstimator, LossAggregation
from algorithms.errors import StableAsyncError
from tasks.config import TASK_CONFIGS

if TYPE_CHECKING:
    from tasks.base import Problem, Task
    from tasks.environment import EnvironmentSpec
    from tasks.sandbox import SandboxLimits


class Section(BaseModel):
    """Base of every job section: unknown keys are errors, values are not coerced silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def _section_from_dataclass(name: str, config_cls: type, suffix: str) -> type[BaseModel]:
    """A pydantic section `{name: <name>, **fields}` mirroring one config dataclass: its fields' bounds
    become the schema's, and the dataclass's own checks across fields run on the validated section."""
    hints = typing.get_type_hints(config_cls)
    fields: dict[str, Any] = {"name": (Literal[name], Field(description=f"selects `{name}`"))}
    for field in dataclasses.fields(config_cls):
        default = field.default if field.default is not dataclasses.MISSING else ...
        bounds = field.metadata.get("bounds", {})
        fields[field.name] = (hints[field.name], Field(default, description=field.metadata.get("doc"), **bounds))

    def dataclass_accepts(section: BaseModel) -> BaseModel:
        config_cls(**section.model_dump(exclude={"name"}))  # a ValueError names the fields out of order
        return section

    checks = {"dataclass_accepts": model_validator(mode="after")(dataclass_accepts)}
    return create_model(f"{config_cls.__name__}{suffix}_{name}", __base__=Section, __validators__=checks, **fields)


def _union(configs: dict[str, type], suffix: str) -> Any:
    models = tuple(_section_from_dataclass(name, cls, suffix) for name, cls in configs.items())
    return Annotated[Union[models], Field(discriminator="name")]  # noqa: UP007 - a runtime tuple


StabilizerSection = _union(STABILIZER_CONFIGS, "Section")
TaskSection = _union(TASK_CONFIGS, "Section")


def section_config(section: BaseModel, configs: dict[str, type]) -> Any:
    """The config dataclass instance a stabilizer or task section describes."""
    values = section.model_dump(exclude={"name"})
    return configs[section.name](**values)  # type: ignore[attr-defined]


class TinyModelSection(Section):
    """A small random-init model built offline, with a tokenizer trained on the task's text."""

    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(128, gt=0)
    num_layers: int = Field(2, gt=0)
    num_heads: int = Field(4, gt=0)
    num_kv_heads: int = Field(2, gt=0)
    head_dim: int = Field(32, gt=0, description="32 is a size the vLLM CPU attention kernels support")
    intermediate_size: int = Field(256, gt=0)
    vocab_size: int = Field(512, gt=0)
    seed: int = 0


class SFTWarmupSection(Section):
    """A short supervised phase on the task's demonstrations before RL (0 steps: none)."""

    steps: int = Field(0, ge=0)
    prompts_per_step: int = Field(32, gt=0)
    learning_rate: float = Field(1e-3, gt=0)


class LoraSection(Section):
    """Train a LoRA adapter (peft) instead of every weight: the generators keep the base model and load each
    policy version's adapter through vLLM's LoRA support, so only the adapter's weights travel."""

    rank: int = Field(16, gt=0, le=512, description="r: the adapter's rank")
    alpha: float = Field(32.0, gt=0, description="lora_alpha: the adapter's output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, le=0, description="dropout on the adapter's input: 0 only, since the learner "
                           "runs every policy forward without dropout (a step's log-probs and ratios must come from "
                           "one function, as in TRL and AReaL)")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="names of the linear layers that get an adapter (the last part of the module "
        "name); each must name a linear layer of the model"
    )


class ModelSection(Section):
    path: str = Field(
        "tiny", description="'tiny' (built offline), a known name (smollm2-135m), a local folder or a hub id"
    )
    tiny: TinyModelSection = TinyModelSection()
    sft_warmup: SFTWarmupSection = SFTWarmupSection()
    lora: LoraSection | None = Field(None, description="train a LoRA adapter only; null: full fine-tuning")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 where the part runs on GPUs (learner ranks train it with fp32 master "
        "weights), float32 on CPU, where bf16 kernels skew log-probs"
    )

    def dtype_on(self, gpu: bool) -> str:
        """The weights' dtype for a part of the job that runs on GPUs (`gpu`) or on CPUs."""
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if gpu else "float32"


class GeneratorSection(Section):
    num_generators: int = Field(1, gt=0)
    samples_per_prompt: int = Field(8, gt=0, description="responses per prompt: the GRPO group size")
    prompts_per_request: int = Field(8, gt=0, description="prompt groups one generate call samples")
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; only 1.0 (off): the learner's log-probs "
                         "cannot mirror a truncated distribution")
    max_model_len: int = Field(512, gt=0, description="prompt plus response tokens the engine accepts")
    kv_cache_mb: int = Field(64, gt=0, description="vLLM KV cache size of a CPU generator; uncapped it takes most "
                             "of RAM. A GPU generator sizes its cache by gpu_memory_utilization")
    gpu_memory_utilization: float = Field(
        0.85, gt=0, le=1, description="share of each GPU a GPU generator's vLLM takes for weights, activations and "
        "KV cache; lower it when something else shares the GPU"
    )
    tensor_parallel_size: int = Field(
        1, gt=0, description="GPUs one generator's engine shards the model over: a placement group of that many "
        "GPU bundles on one node, vLLM's ray executor. gpus_per_generator must equal it"
    )
    cuda_graphs: bool = Field(True, description="capture CUDA graphs for decoding (GPU generators); off runs eager, "
                              "slower, for debugging")
    prefix_caching: bool = Field(True, description="reuse the KV blocks of a prompt that a group's samples share "
                                 "(GPU generators; the cache is reset at every weight load)")
    max_num_seqs: int | None = Field(None, gt=0, description="sequences a GPU engine decodes at once; none: vLLM's "
                                     "default")
    max_restarts: int = Field(
        3, ge=0, description="times a dead generator process is restarted; its in-flight groups are issued again"
    )
    max_generators: int | None = Field(
        None, gt=0,
        description="elastic: while the job runs, start a generator on every free unit of cluster.generator_resource "
        "(nodes the autoscaler adds) up to this many, and carry on without generators whose node left; "
        "none keeps num_generators fixed",
    )
    streaming: bool = Field(
        False, description="run each generator as a streaming engine (vLLM's AsyncLLM): several generate calls "
        "at once, and new weights loaded while requests are in flight, each token labelled with the policy version "
        "that sampled it (a group's lag counts from its oldest token)")
    requests_in_flight: int = Field(4, gt=0, description="streaming: generate calls one generator samples at once")
    cpus_per_generator: float = Field(1.0, gt=0)
    gpus_per_generator: float = Field(0.0, ge=0)


def _token_budget(value: Any) -> Any:
    """`auto` or a whole number of tokens above 0, in one error (a union would report each of its members)."""
    if value == "auto" or (type(value) is int and value > 0):
        return value
    raise ValueError(f"{value!r} is neither auto nor a whole number of tokens above 0")


class LearnerSection(Section):
    num_ranks: int = Field(1, gt=0, description="DeepSpeed data-parallel ranks, one Ray actor each")
    zero_stage: Literal[0, 1, 2, 3] = 2
    steps: int = Field(100, gt=0, description="optimizer steps (policy versions) to train")
    prompts_per_step: int = Field(8, gt=0, description="prompt groups per optimizer step, over all ranks")
    learning_rate: float = Field(1e-6, gt=0)
    lr_warmup_steps: int = Field(0, ge=0, description="RL steps over which the learning rate ramps up linearly to "
                                 "learning_rate (the SFT warm-up has its own rate)")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="after the warm-up: constant, or a linear or cosine decay to "
        "lr_min_ratio x learning_rate at the last step"
    )
    lr_min_ratio: float = Field(0.0, ge=0, le=1, description="where a linear or cosine decay ends, as a fraction of "
                                "learning_rate")
    weight_decay: float = Field(0.0, ge=0)
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon; larger values damp steps of near-zero gradients")
    grad_clip: float = Field(1.0, gt=0)
    max_tokens_per_micro_batch: Annotated[int | Literal["auto"], BeforeValidator(_token_budget)] = Field(
        "auto", description="tokens a rank runs through the model at once (real tokens in a packed micro-batch, "
        "rows x longest row in a padded one); a step "
        "accumulates as many micro-batches as its batch needs, with the same update. auto: what the memory left "
        "on the rank's device holds, from the model's size (the run's log gives each rank's choice and why); a "
        "number: at least generator.max_model_len, lower when a step runs out of memory"
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each layer's activations in the backward: less memory, about a third "
        "more compute per step"
    )
    packed_micro_batches: bool = Field(
        True, description="run each micro-batch's rows as one sequence without padding (position ids restarting "
        "per row, attention within each row: flash-attn's or PyTorch's varlen kernel on a GPU, else SDPA per row), "
        "so its budget counts real tokens, VCPO's steps included. false: right-padded rows"
    )
    max_restarts: int = Field(
        2, ge=0, description="times the job resumes by itself from its latest checkpoint after a learner rank dies"
    )
    max_skipped_steps_in_a_row: int = Field(
        5, gt=0, description="consecutive steps skipped for non-finite values before the job stops (with a checkpoint)"
    )
    mini_batches: int = Field(
        1, gt=0, description="optimizer updates per pass over a step's batch, each on its own share of the prompt "
        "groups (PPO's mini-batches); more than one needs algorithm.proximal: recompute"
    )
    epochs: int = Field(1, gt=0, description="passes over a step's batch; more than one needs algorithm.proximal: "
                        "recompute")
    cpus_per_rank: float = Field(1.0, gt=0)
    gpus_per_rank: float = Field(0.0, ge=0)


class KLSection(Section):
    """A KL term to the frozen initial policy (verl's kl loss or kl in reward, OpenRLHF's init_kl_coef, TRL's
    beta): the reference's log-probs come from a second copy of the starting model on the learner ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    coef: float = Field(0.001, gt=0, description="weight of the KL term (the starting value with `target`)")
    estimator: KLEstimator = Field(
        "low_var+", description="per-token estimator of KL(policy || reference) from l = log pi - log ref: k1 = l, "
        "k2 = l^2 / 2, k3 = exp(-l) - 1 + l, low_var = k3 bounded to [-10, 10] (verl's low_var_kl); k3+ and "
        "low_var+ have k3's and low_var's value with k2's gradient. In the loss only k2, k3+ and low_var+ follow "
        "the gradient of KL(policy || reference): k3 and low_var follow KL(reference || policy)'s, and k1 "
        "(refused there) has none"
    )
    in_: Literal["loss", "reward"] = Field(
        "loss", alias="in", description="loss: coef x the aggregated token KL is added to the loss (GRPO's way); "
        "reward: coef x each response's summed KL, from its behaviour log-probs, is subtracted from its reward "
        "before the advantages (PPO's way)"
    )
    target: float | None = Field(
        None, gt=0, description="adaptive coefficient: after each step the coefficient moves towards keeping "
        "stability/kl_ref_mean (per token) at this value, by at most 20% of the gap per `horizon` sequences"
    )
    horizon: int = Field(10000, gt=0, description="adaptive coefficient: sequences over which it may move by 20%")
    reference: Literal["rl_start", "model"] = Field(
        "rl_start", description="the policy the KL measures against: rl_start, the policy RL starts from (after "
        "model.sft_warmup, which is written to RUN_DIR/reference and loaded from there; verl's and OpenRLHF's "
        "reference), or model, model.path as it loads (before any warm-up)")


class AlgorithmSection(Section):
    stabilizer: StabilizerSection = Field(  # type: ignore[valid-type]
        default_factory=lambda: {"name": "tis_seq"}, validate_default=True
    )
    advantage: Literal["grpo", "dr_grpo", "reinforce", "rloo"] = "grpo"
    loss_aggregation: LossAggregation = "token-mean"
    proximal: Literal["behaviour", "recompute"] = Field(
        "behaviour", description="the decoupled objective (AReaL): recompute takes the learner's own log-probs at "
        "the start of each step (one no-grad pass) as the proximal policy. The stabilizer corrects the staleness "
        "against it, and each of the step's updates (learner.mini_batches x learner.epochs) is clipped to "
        "proximal_eps_low/high around it. behaviour: one update, the stabilizer against the behaviour policy"
    )
    proximal_eps_low: float = Field(0.2, gt=0, lt=1, description="recompute: ratios pi/pi_prox below 1 - eps_low "
                                    "get no gradient where the advantage is negative")
    proximal_eps_high: float = Field(0.2, gt=0, description="recompute: ratios pi/pi_prox above 1 + eps_high get no "
                                     "gradient where the advantage is positive")
    constant_tokens: int | None = Field(None, gt=0, description="the constant length of `constant` aggregation")
    kl: KLSection | None = Field(None, description="a KL term to the frozen starting policy; null: none")
    entropy_coef: float = Field(
        0.0, ge=0, description="entropy bonus: the loss loses this times the aggregated token entropy of the policy "
        "(from the same chunked log-softmax as the log-probs); 0: off"
    )
    drop_uniform_groups: bool = Field(
        False, description="DAPO's dynamic sampling: a prompt group whose responses all scored the same (all solved "
        "or all failed, so every advantage is 0) is dropped when scored, in the ledger with why, and the generators "
        "sample another in its place: each step trains prompts_per_step groups that carry a learning signal"
    )
    overlong_buffer_tokens: int = Field(
        0, ge=0, description="DAPO's soft overlong punishment: over the last N tokens before generator.max_new_tokens, "
        "a response's reward falls linearly, down to -overlong_penalty at the cap; 0: off"
    )
    overlong_penalty: float = Field(1.0, ge=0, description="the reward a response reaching generator.max_new_tokens "
                                    "loses (with overlong_buffer_tokens)")
    max_uniform_groups_in_a_row: int = Field(
        256, gt=0, description="with drop_uniform_groups: after this many groups in a row are dropped so, the job "
        "stops with a checkpoint (the policy solves each problem it draws always or never: the task is too easy or "
        "too hard for it, or it stopped exploring)"
    )


class AsyncSection(Section):
    max_lag: int = Field(
        1, ge=0, description="learner version minus rollout version allowed at train time; 0 is on-policy"
    )
    stale_policy: Literal["wait", "drop"] = Field(
        "wait", description="wait: generators pause so nothing goes stale; drop: stale groups are dropped (ledger)"
    )
    weight_sync: Literal["object_store", "nccl", "gloo"] = Field(
        "object_store",
        description="object_store (default): one buffer in Ray's object store, which generators may join and leave; "
        "nccl: GPU to GPU from learner rank 0 through vLLM's weight-transfer engine; gloo: the same broadcast on CPU",
    )


class ClusterSection(Section):
    address: str | None = Field(None, description="Ray address; none starts a local cluster")
    num_cpus: int | None = Field(None, gt=0, description="logical CPUs of the local cluster")
    namespace: str = "stableasync"
    generator_resource: str | None = Field(
        None, description="custom node resource every generator takes one unit of ('generator' on the deploy "
        "YAMLs' generator nodes); none: any node with the CPUs/GPUs"
    )
    learner_resource: str | None = Field(
        None, description="custom node resource every learner rank takes one unit of ('learner' on the deploy "
        "YAMLs' learner nodes); none: any node"
    )
    placement_timeout_s: float = Field(
        600.0, gt=0, description="how long the learner's placement group may wait for resources before the job fails"
    )


class WandbSection(Section):
    mode: Literal["online", "offline", "disabled"] = "offline"
    project: str = "stableasync"
    entity: str | None = None


class AlertsSection(Section):
    """Stability alerts (log line, W&B alert when online) on RL steps: each rule alerts once when its
    condition starts and again only after it has cleared. A null threshold turns its rule off."""

    ess_ratio_below: float | None = Field(
        0.1, ge=0, le=1, description="ESS collapse: stability/ess_ratio below this (or NaN) for ess_collapse_steps "
        "steps in a row; null: no ESS alert"
    )
    ess_collapse_steps: int = Field(3, gt=0, description="consecutive low-ESS steps that make a collapse")
    entropy_below: float | None = Field(
        None, ge=0, description="entropy collapse: stability/entropy (nats per token) below this (or NaN) for "
        "entropy_collapse_steps steps in a row; null: no entropy alert (a sensible value depends on the task)"
    )
    entropy_collapse_steps: int = Field(5, gt=0, description="consecutive low-entropy steps that make a collapse")
    grad_norm_above: float | None = Field(
        None, gt=0,
        description="gradient-norm spike: optim/grad_norm above this absolute value; null: no absolute limit",
    )
    grad_norm_spike_factor: float | None = Field(
        10.0, gt=1, description="gradient-norm spike: optim/grad_norm above this times the median of the previous "
        "grad_norm_window_steps steps; null: no relative rule (a NaN norm is a spike while either rule is on)"
    )
    grad_norm_window_steps: int = Field(
        20, gt=0, description="steps in the running median of the relative rule; it applies once that many are seen"
    )


class SamplesSection(Section):
    """Rollout samples a person reads (`RUN_DIR/samples.jsonl` and a W&B table)."""

    every_steps: int = Field(10, ge=0, description="log samples every N steps and at the last; 0: never")
    groups: int = Field(2, gt=0, description="prompt groups of the step logged each time (all their responses)")
    max_chars: int = Field(2000, gt=0, description="longest completion text logged; longer ones are cut")


class LoggingSection(Section):
    run_dir: str = Field("runs", description="parent folder of this job's run directory")
    run_name: str | None = None
    wandb: WandbSection = WandbSection()
    progress_bar: bool = True
    alerts: AlertsSection = AlertsSection()
    samples: SamplesSection = SamplesSection()


class CheckpointSection(Section):
    every_steps: int = Field(0, ge=0, description="checkpoint every N steps and at the last; 0: none")
    keep: int = Field(2, gt=0)
    save_model: bool = Field(True, description="write the trained policy to RUN_DIR/model at the end of the run, "
                             "as a Hugging Face model folder (safetensors, config, tokenizer)")
    stop_grace_s: int = Field(
        300, gt=0, description="seconds `stableasync stop` gives a submitted job to finish its learner step and "
        "write its checkpoint before Ray kills it (RAY_JOB_STOP_WAIT_TIME_S; Ray's own default is 3)"
    )


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
    path: str | None = Field(None, description="reward_model: a local model folder (config, weights, tokenizer) or a "
                             "Hugging Face hub id (downloaded once to the cache)")
    batch_size: int | None = Field(None, gt=0, description="reward_model: texts per forward pass (default 8)")
    timeout_s: float | None = Field(None, gt=0, description="reward_model: seconds one group's scoring may take; "
                                    "past it the group's samples fail and the actor is replaced (default 60)")
    gpus: float | None = Field(None, ge=0, description="reward_model: GPUs of its actor (default 0: on CPU)")
    max_length: int | None = Field(None, gt=0, description="reward_model: tokens of prompt and completion it reads, "
                                   "cut from the left (default 1024)")

    @model_validator(mode="before")
    @classmethod
    def kind_fields(cls, data: Any) -> Any:
        """Fill in the kind's defaults; refuse a field the kind does not take, or a required one left out."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or data["name"] not in REWARD_KINDS:
            return data  # the `name` field reports it
        kind, fields = data["name"], REWARD_KINDS[data["name"]]
        foreign = sorted(str(key) for key, value in data.items()  # null: as the resolved job writes them
                         if key not in {"name", "weight", *fields} and value is not None)
        if foreign:
            raise ValueError(f"{', '.join(foreign)}: not a field of a {kind!r} reward (its fields: "
                             f"{', '.join(['name', 'weight', *fields])})")
        missing = [key for key, default in fields.items() if default is None and data.get(key) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)}: required for a {kind!r} reward")
        return {**{k: v for k, v in fields.items() if v is not None}, **data}


class ScoringSection(Section):
    """Reward workers (`tasks/scoring.py`): each completion is scored in a verifier subprocess, so a verifier
    that raises, hangs or eats memory fails only its own sample."""

    rewards: list[RewardSection] | None = Field(
        None, min_length=1, description="a composite reward: the sum of weight x each component, each logged as "
        "rollout/reward_<name>_mean; a component that fails a sample fails it (reward 0, the reason in the "
        "ledger). One component per name. None: the task's verifier alone"
    )

    workers: int = Field(1, gt=0, description="verifier subprocesses scoring a group's completions in parallel")
    timeout_s: float = Field(
        5.0, gt=0, description="seconds one completion may take to score; past it the sample fails (reward 0, a "
        "score error in the ledger) and its worker is replaced"
    )
    memory_limit_mb: int | None = Field(
        4096, gt=0, description="address space each worker may add to what it holds once its task is built; a "
        "verifier past it fails its sample; null: no limit"
    )
    startup_timeout_s: float = Field(
        120.0, gt=0, description="seconds a worker may take to import and build the task before the job stops"
    )


class EnvironmentSection(Section):
    """Multi-turn episodes with tools (`tasks/environment.py`): the policy calls tools between its turns; their
    results are context, never trained on. No tools: one turn, the answer."""

    tools: list[str] = Field(default_factory=list, description="tools the policy may call: built-in names "
                             "(calculator, countdown_check) or your own function as 'FILE.py:NAME' or 'module:NAME'")
    max_turns: int = Field(4, ge=1, description="policy turns per episode, the answer's included; the episode "
                           "ends there even mid-call")
    tool_call_format: Literal["hermes"] = Field(
        "hermes", description='how a turn writes tool calls: hermes is <tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call>")
    tool_timeout_s: float = Field(5.0, gt=0, description="seconds one tool call may run; past it the episode fails "
                                  "(reason in the ledger) and the tool's worker is replaced")
    tool_memory_limit_mb: int | None = Field(1024, gt=0, description="address space a tool worker may add once "
                                             "started; past it the episode fails; null: no limit")
    max_tool_output_chars: int = Field(4096, gt=0, description="characters a tool may return or print; more "
                                       "fails the episode")
    tool_workers: int = Field(1, gt=0, description="tool subprocesses per generator, running a round's calls in "
                              "parallel")
    train_failed_episodes: bool = Field(
        False, description="train an episode that failed for its tools' sake (a tool raised, hung, ran out of "
        "memory or printed too much) as a wrong answer at reward 0; false: it is left out of training, the "
        "reason in the ledger (its group is dropped when fewer than two responses are left)")


class SandboxSection(Section):
    """Where untrusted code runs (`tasks/sandbox.py`, docs/security.md): the task's verifier, a user's reward
    function and the tools the policy calls, each call in a process group of its own that a timeout or the end
    of the call kills, with an environment of its own, limits and a private working directory."""

    isolation: Literal["none", "namespaces", "auto"] = Field(
        "auto", description="namespaces: network, mount and PID namespaces (unshare): no network, the filesystem "
        "read-only but a private temp dir; refused by `validate` on a machine where they cannot start. none: "
        "process limits alone. auto: namespaces where they start, else none (the worker logs which)")
    env: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]] = Field(
        default_factory=list, description="environment variables passed to the sandbox by name; it gets no "
        "other but PATH and LANG (HOME and TMPDIR are its private directory)")
    cpu_s: float = Field(60.0, gt=0, description="CPU seconds one call may use; past it the call fails")
    max_processes: int = Field(64, gt=0, description="processes and threads a sandbox may add (a fork bomb stops "
                               "there)")
    max_file_mb: int = Field(256, gt=0, description="size of a file a call may write, in MiB")
    max_open_files: int = Field(256, gt=0, description="file descriptors a sandbox may hold open")
    max_output_chars: int = Field(65536, gt=0, description="bytes a verifier or reward function may write to its "
                                  "stdout and stderr per call; more fails the sample (tools: "
                                  "environment.max_tool_output_chars)")


# The tasks that read a data file (their config has a `path`): the formats an evaluation set's file may have.
FILE_TASKS = tuple(name for name, config in TASK_CONFIGS.items()
                   if "path" in {field.name for field in dataclasses.fields(config)})
EVAL_SET_NAME = r"^[A-Za-z0-9_-]+$"  # it becomes part of metric keys (eval/NAME/solved) and of --set paths
DEFAULT_EVAL_SET = "default"  # what `stableasync evaluate` calls the unnamed set of eval.num_problems
# Fields of a set's task config that serve training only: an evaluation set is answered, never demonstrated.
EVAL_SET_TASK_RESETS: dict[str, Any] = {"max_rows": None, "demonstration_field": None}


class EvalSetSection(Section):
    """One named evaluation set: a JSONL file the policy answers at every evaluation, logged as `eval/NAME/*`."""

    path: str = Field(description="JSONL file of the set's problems; a relative path is from the working directory")
    task: Literal[FILE_TASKS] | None = Field(  # type: ignore[valid-type]
        None, description="the task format that reads the file and scores its answers: gsm8k (rows {question, "
        "answer: '... #### GOLD'}) or dataset (rows {prompt, answer}, see prompt_field); default: the job's task, "
        "which must read a file")
    prompt_field: str | None = Field(None, description="dataset sets: the field with the prompt (default: the job's "
                                     "task.prompt_field for a dataset job, else 'prompt')")
    answer_field: str | None = Field(None, description="dataset sets: the field with the gold answer (default: the "
                                     "job's task.answer_field for a dataset job, else 'answer')")
    num_problems: int | None = Field(None, gt=0, description="problems drawn from the file, a seeded sample that "
                                     "stays the same at every evaluation; none: every row")
    samples_per_problem: int | None = Field(None, gt=0, description="answers per problem, k of pass@k; none: "
                                            "eval.samples_per_problem")
    temperature: float | None = Field(None, ge=0, description="sampling temperature; none: eval.temperature")


class EvalSection(Section):
    """Periodic evaluation: the policy answers one fixed set of problems; `eval/*` metrics at those steps."""

    every_steps: int = Field(0, ge=0, description="evaluate after every N learner steps and the last; 0: never")
    before_training: bool = Field(False, description="also evaluate the starting policy (after any SFT warm-up) "
                                  "as step 0, beside the first RL steps: the baseline the run is measured against")
    num_problems: int = Field(64, gt=0, description="size of the fixed evaluation set (fewer if the data has fewer)")
    temperature: float = Field(0.0, ge=0, description="sampling temperature; 0: greedy")
    samples_per_problem: int = Field(1, gt=0, description="answers per problem (needs temperature > 0 when above "
                                     "1); eval/solved is then the mean over all answers (avg@k), and "
                                     "eval/pass_at_k the share of problems with a correct answer among them")
    pass_at: list[int] = Field(
        default_factory=list, description="k's of eval/pass_at_K, each estimated without bias from the "
        "samples_per_problem answers of every set (1 - C(n - c, k) / C(n, k) per problem, n answers of which c are "
        "correct; each k at most n), beside eval/pass_at_k (k = n) and eval/maj_at_k")
    task_path: str | None = Field(None, description="data file of the evaluation set for a task that reads one "
                                  "(gsm8k: the test split); default: the task's own data, drawn in another order")
    sets: dict[str, EvalSetSection] = Field(
        default_factory=dict, description="named evaluation sets answered at the same steps as the set above, "
        "each logged under its own keys eval/NAME/* (docs/tasks.md); names are letters, digits, _ and -")


class Job(Section):
    """One training job: its sections as the README's job file shows them; every field has a default but `task`."""

    name: str = Field("job", pattern=r"^[A-Za-z0-9_.-]+$")
    seed: int = 0
    model: ModelSection = ModelSection()
    task: TaskSection  # type: ignore[valid-type]
    scoring: ScoringSection = ScoringSection()
    generator: GeneratorSection = GeneratorSection()
    learner: LearnerSection = LearnerSection()
    algorithm: AlgorithmSection = AlgorithmSection()
    async_: AsyncSection = Field(AsyncSection(), alias="async")
    cluster: ClusterSection = ClusterSection()
    logging: LoggingSection = LoggingSection()
    checkpoint: CheckpointSection = CheckpointSection()
    eval: EvalSection = EvalSection()
    environment: EnvironmentSection = EnvironmentSection()
    sandbox: SandboxSection = SandboxSection()

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


def job_section_defaults(dotted: str) -> dict[str, Any]:
    """Today's default of every key of a job section ("learner", "logging.alerts"), as job.yaml spells them:
    what readers of older runs fill in for keys those runs lack."""
    section: Any = Job
    for part in dotted.split("."):
        fields = {info.alias or name: info for name, info in section.model_fields.items()}
        if part not in fields:
            raise KeyError(f"the job schema has no section {dotted!r}")
        section = fields[part].annotation
    return section().model_dump(mode="json", by_alias=True)


@dataclasses.dataclass(frozen=True)
class JobError:
    """One problem in a job file: the dotted field path and what is wrong."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


class JobValidationError(StableAsyncError, ValueError):
    """All the errors of a job file at once."""

    def __init__(self, source: str, errors: list[JobError]) -> None:
        self.source, self.errors = source, errors
        lines = "\n".join(f"  {error}" for error in errors)
        super().__init__(f"{source}: {len(errors)} error(s)\n{lines}")


def _pydantic_errors(error: ValidationError) -> list[JobError]:
    out = []
    for item in error.errors():
        path = ".".join(_user_path([str(part) for part in item["loc"]])) or "(top level)"
        out.append(JobError(path, item["msg"].removeprefix("Value error, ")))  # a check's own words
    return out


def _user_path(loc: list[str]) -> list[str]:
    """Drop pydantic's union-member tags (e.g. 'tis_seq') that follow a discriminated field."""
    cleaned: list[str] = []
    for i, part in enumerate(loc):
        if i > 0 and loc[i - 1] in ("stabilizer", "task") and part in {*STABILIZER_CONFIGS, *TASK_CONFIGS}:
            continue
        cleaned.append("async" if part == "async_" else part)
    return cleaned


def cross_field_errors(job: Job, cluster_resources: dict[str, float] | None = None) -> list[JobError]:
    """Checks that span fields: sizes divisible, resources satisfiable, options consistent.

    `cluster_resources` (Ray's totals) adds the checks against the cluster the job is about to start on.
    """
    errors: list[JobError] = []
    available_cpus = cluster_resources.get("CPU", 0.0) if cluster_resources is not None else None
    available_gpus = cluster_resources.get("GPU", 0.0) if cluster_resources is not None else None
    learner, generator = job.learner, job.generator
    if learner.prompts_per_step % learner.num_ranks:
        errors.append(JobError(
            "learner.prompts_per_step",
            f"{learner.prompts_per_step} prompt groups cannot be split evenly over {learner.num_ranks} ranks "
            "(each prompt group stays on one rank)",
        ))
    updates = learner.mini_batches * learner.epochs
    if updates > 1 and job.algorithm.proximal != "recompute":
        errors.append(JobError("algorithm.proximal", f"{updates} updates per step (learner.mini_batches x "
                               "learner.epochs) need recompute: after the first update the learner's policy has moved, "
                               "and the later ones are clipped around the step's starting policy"))
    groups_per_rank, rest = divmod(learner.prompts_per_step, learner.num_ranks)
    if not rest and groups_per_rank % learner.mini_batches:
        errors.append(JobError(
            "learner.mini_batches",
            f"{groups_per_rank} prompt groups per rank cannot be split evenly into "
            f"{learner.mini_batches} mini-batches (each prompt group stays in one)",
        ))
    if learner.lr_warmup_steps > learner.steps:
        errors.append(JobError("learner.lr_warmup_steps",
                               f"{learner.lr_warmup_steps} warm-up steps is more than the {learner.steps} steps"))
    if job.algorithm.drop_uniform_groups and generator.samples_per_prompt == 1:
        errors.append(JobError("algorithm.drop_uniform_groups", "every group of one response "
                               "(generator.samples_per_prompt 1) has uniform rewards: all would be dropped"))
    if job.algorithm.overlong_buffer_tokens > generator.max_new_tokens:
        errors.append(JobError("algorithm.overlong_buffer_tokens", f"{job.algorithm.overlong_buffer_tokens} is more "
                               f"than the {generator.max_new_tokens} tokens a response may have "
                               "(generator.max_new_tokens)"))
    if generator.top_p < 1:
        errors.append(JobError("generator.top_p", f"{generator.top_p} is not supported: vLLM's log-probs of a "
                               "nucleus-sampled token are renormalised over the nucleus, while the learner's are over "
                               "the whole vocabulary, so every importance ratio would be biased even on-policy; use "
                               "1.0 and set the sampling's spread with generator.temperature"))
    errors += _environment_errors(job)
    if job.model.lora is not None:
        lora_limits = [("learner.zero_stage", learner.zero_stage == 3, "ZeRO-3 with LoRA is not supported yet; the "
                        "adapter is small, so use zero_stage 2"),
                       ("async.weight_sync", job.async_.weight_sync != "object_store", "a LoRA adapter travels through "
                        "the object store only; use object_store"),
                       ("generator.streaming", generator.streaming, "streaming generators do not load LoRA adapters "
                        "yet; use streaming: false")]
        errors += [JobError(field, why) for field, refused, why in lora_limits if refused]
    kl = job.algorithm.kl
    if kl is not None and kl.reference == "rl_start" and job.model.lora is not None and job.model.sft_warmup.steps:
        errors.append(JobError("algorithm.kl.reference", "rl_start after an SFT warm-up is not there with LoRA: the "
                               "reference is the base model with the adapter switched off, the policy before the "
                               "warm-up; set algorithm.kl.reference: model to measure against it"))
    stabilizer_normalises = getattr(job.algorithm.stabilizer, "norm_by_std", None)  # VCPO forms its own advantages
    std_normalised = (job.algorithm.advantage == "grpo" if stabilizer_normalises is None else stabilizer_normalises)
    if kl is not None and kl.in_ == "reward" and std_normalised:
        knob = ("algorithm.advantage (grpo)" if stabilizer_normalises is None
                else "algorithm.stabilizer.norm_by_std")
        errors.append(JobError("algorithm.kl.in", f"reward subtracts the KL before {knob} divides each group by "
                               "its reward std, so in a group whose rewards are equal the advantages come from KL "
                               "differences alone at unit scale; with `in: reward` take an advantage without the "
                               "std (dr_grpo, rloo or reinforce; norm_by_std: false for vcpo), or put the KL in "
                               "the loss (`in: loss`)"))
    if kl is not None and kl.in_ == "loss" and kl.estimator == "k1":
        errors.append(JobError("algorithm.kl.estimator", "k1 as a loss term has an expected gradient of 0 (its "
                               "value is log pi - log ref, whose expectation's gradient under the policy's own "
                               "samples vanishes); use low_var+ or k2 in the loss, or k1 with `in: reward`"))
    token_terms = (job.algorithm.kl is not None and job.algorithm.kl.in_ == "loss") or job.algorithm.entropy_coef > 0
    if token_terms and getattr(job.algorithm.stabilizer, "opob_impl", None) == "bookkeeping":
        errors.append(JobError("algorithm.stabilizer.opob_impl", "bookkeeping forms each sequence's whole gradient "
                               "from its log-prob alone, so it cannot carry a KL term in the loss or an entropy bonus; "
                               "use ghost or auto (which then takes ghost)"))
    if job.algorithm.loss_aggregation == "constant" and job.algorithm.constant_tokens is None:
        errors.append(JobError("algorithm.constant_tokens", "required when loss_aggregation is 'constant'"))
    if generator.max_new_tokens >= generator.max_model_len:
        errors.append(JobError(
            "generator.max_new_tokens",
            f"{generator.max_new_tokens} leaves no room for the prompt in max_model_len {generator.max_model_len}",
        ))
    if learner.max_tokens_per_micro_batch != "auto" and learner.max_tokens_per_micro_batch < generator.max_model_len:
        errors.append(JobError(
            "learner.max_tokens_per_micro_batch",
            f"{learner.max_tokens_per_micro_batch} is less than one sequence may hold (generator.max_model_len "
            f"{generator.max_model_len}); raise it, or lower max_model_len",
        ))
    if generator.tensor_parallel_size > 1 and generator.gpus_per_generator != generator.tensor_parallel_size:
        errors.append(JobError(
            "generator.tensor_parallel_size",
            f"{generator.tensor_parallel_size} GPUs per engine needs gpus_per_generator "
            f"{generator.tensor_parallel_size}, not {generator.gpus_per_generator:g}",
        ))
    if generator.gpus_per_generator > 1 and generator.tensor_parallel_size == 1:
        errors.append(JobError(
            "generator.gpus_per_generator",
            f"{generator.gpus_per_generator:g} GPUs for an engine of tensor_parallel_size 1 would leave all but one "
            "idle; set tensor_parallel_size to use them, or run more generators",
        ))
    if job.async_.weight_sync == "nccl" and (generator.gpus_per_generator == 0 or learner.gpus_per_rank == 0):
        errors.append(JobError("async.weight_sync",
                               "nccl needs GPUs on generators and learner ranks; use object_store"))
    if generator.max_generators is not None:
        if job.cluster.generator_resource is None:
            errors.append(JobError("cluster.generator_resource",
                                   "required when generator.max_generators is set: elastic generators follow the "
                                   "nodes that offer this resource"))
        if generator.max_generators < generator.num_generators:
            errors.append(JobError("generator.max_generators",
                                   f"{generator.max_generators} is fewer than num_generators "
                                   f"{generator.num_generators}"))
        if job.async_.weight_sync != "object_store":
            errors.append(JobError("async.weight_sync", "elastic generators (generator.max_generators) need "
                                   "object_store: a collective weight group cannot take new members"))
    errors += _scoring_errors(job, available_cpus if available_cpus is not None else job.cluster.num_cpus,
                              available_gpus)
    if any(k < 1 or k > job.eval.samples_per_problem for k in job.eval.pass_at):
        errors.append(JobError("eval.pass_at", f"each k must be from 1 to eval.samples_per_problem "
                               f"({job.eval.samples_per_problem}): pass@k is estimated from at least k answers, "
                               f"got {job.eval.pass_at}"))
    if job.eval.samples_per_problem > 1 and job.eval.temperature == 0:
        errors.append(JobError("eval.samples_per_problem", f"{job.eval.samples_per_problem} greedy answers "
                               "(eval.temperature 0) would all be the same; set eval.temperature > 0, or 1 answer"))
    if job.eval.task_path is not None and not hasattr(job.task, "path"):
        errors.append(JobError("eval.task_path", f"task {job.task.name!r} reads no data file; leave it unset"))
    errors += _eval_set_errors(job)
    if job.model.path == "tiny" and job.model.tiny.num_heads % job.model.tiny.num_kv_heads:
        errors.append(JobError("model.tiny.num_kv_heads", "must divide num_heads"))
    cpus_needed = generator.num_generators * generator.cpus_per_generator + learner.num_ranks * learner.cpus_per_rank
    gpus_needed = generator.num_generators * generator.gpus_per_generator + learner.num_ranks * learner.gpus_per_rank
    cpu_limit = available_cpus if available_cpus is not None else job.cluster.num_cpus
    if cpu_limit is not None and cpus_needed > cpu_limit:
        errors.append(JobError(
            "cluster.num_cpus" if available_cpus is None else "generator.num_generators",
            f"the job needs {cpus_needed:g} CPUs ({generator.num_generators} generators x "
            f"{generator.cpus_per_generator:g} + {learner.num_ranks} ranks x {learner.cpus_per_rank:g}) "
            f"but the cluster has {cpu_limit:g}",
        ))
    if available_gpus is not None and gpus_needed > available_gpus:
        errors.append(JobError(
            "generator.gpus_per_generator",
            f"the job needs {gpus_needed:g} GPUs but the cluster has {available_gpus:g}",
        ))
    if cluster_resources is not None:
        for field, resource, count in (("cluster.generator_resource", job.cluster.generator_resource,
                                        generator.num_generators),
                                       ("cluster.learner_resource", job.cluster.learner_resource, learner.num_ranks)):
            units = cluster_resources.get(resource, 0.0) if resource else None
            if units is not None and units < count:
                errors.append(JobError(
                    field, f"the job starts {count} actor(s) on nodes with resource {resource!r}, but the cluster "
                    f"offers {units:g} unit(s) of it (add such nodes, or start with fewer)",
                ))
    return errors


def _environment_errors(job: Job) -> list[JobError]:
    """Tools the policy may call: a built-in name, or a user's 'FILE.py:NAME' (the file is read by `validate` and
    `train`, not here: it may be on the cluster only)."""
    from tasks.tools import BUILTIN_TOOLS  # standard library only

    errors = []
    for index, name in enumerate(job.environment.tools):
        where = f"environment.tools.{index}"
        path, colon, function = name.rpartition(":")
        if not colon and name not in BUILTIN_TOOLS:
            errors.append(JobError(where, f"unknown tool {name!r}; built-in: {', '.join(sorted(BUILTIN_TOOLS))}, or "
                                          "your own as 'FILE.py:NAME' or 'module:NAME'"))
        elif colon and (not function.isidentifier() or not path):
            errors.append(JobError(where, f"{name!r}: give a tool of your own as 'FILE.py:NAME' or 'module:NAME'"))
    if len(set(job.environment.tools)) != len(job.environment.tools):
        errors.append(JobError("environment.tools", "a tool is listed twice"))
    return errors


def eval_set_task(job: Job, name: str) -> str | None:
    """The task that reads eval set `name`'s file: its own `task`, else the job's when that reads files."""
    chosen = job.eval.sets[name].task
    return chosen if chosen is not None else (job.task.name if job.task.name in FILE_TASKS else None)


def _eval_set_errors(job: Job) -> list[JobError]:
    """eval.sets: names that fit in metric keys, a task format that reads the file, fields that format has, and
    sampled answers when there are several per problem. The files themselves are read with the task's data
    (`evaluation_sets`), so `validate --schema-only` passes a job whose data is on the cluster."""
    errors = []
    for name, spec in job.eval.sets.items():
        where = f"eval.sets.{name}"
        if not re.fullmatch(EVAL_SET_NAME, name):
            errors.append(JobError(where, "a set name is letters, digits, _ and - only: it becomes the metric keys "
                                          f"eval/{name}/*"))
        elif name == DEFAULT_EVAL_SET:
            errors.append(JobError(where, f"{DEFAULT_EVAL_SET!r} names the unnamed set of eval.num_problems "
                                          "(`stableasync evaluate --sets`); pick another name"))
        task = eval_set_task(job, name)
        if task is None:
            errors.append(JobError(f"{where}.task", f"required: the job's task {job.task.name!r} reads no data "
                                                    f"file; give the file's format ({', '.join(FILE_TASKS)})"))
        else:
            errors += [JobError(f"{where}.{key}", f"the {task!r} format has no {key}; only "
                                f"{' or '.join(t for t in FILE_TASKS if key in _config_fields(t))} sets read one")
                       for key in ("prompt_field", "answer_field")
                       if getattr(spec, key) is not None and key not in _config_fields(task)]
        samples = spec.samples_per_problem or job.eval.samples_per_problem
        if any(k > samples for k in job.eval.pass_at):
            errors.append(JobError("eval.pass_at", f"{max(job.eval.pass_at)} is more than the {samples} answers per "
                                   f"problem of {where}: pass@k is estimated from at least k answers"))
        temperature = job.eval.temperature if spec.temperature is None else spec.temperature
        if samples > 1 and temperature == 0:
            field = "samples_per_problem" if spec.samples_per_problem is not None else "temperature"
            errors.append(JobError(f"{where}.{field}", f"{samples} greedy answers (temperature 0) would all be the "
                                   "same; set the set's temperature > 0, or 1 answer"))
    return errors


def _config_fields(task: str) -> set[str]:
    """The fields of a task's config (`tasks/config.py`)."""
    return {field.name for field in dataclasses.fields(TASK_CONFIGS[task])}


def _scoring_errors(job: Job, cpu_limit: float | None, available_gpus: float | None) -> list[JobError]:
    """scoring.rewards: one component per name (each is its own metric); room on the cluster for the reward model
    actors (one CPU each, and their GPUs) beside the generators and learner ranks."""
    rewards = job.scoring.rewards or []
    errors = [JobError(f"scoring.rewards.{i}.name", f"a second {r.name!r} component (one per name: each is logged "
                       f"as rollout/reward_{r.name}_mean)")
              for i, r in enumerate(rewards) if r.name in {earlier.name for earlier in rewards[:i]}]
    models = [(i, r) for i, r in enumerate(rewards) if r.name == "reward_model"]
    if not models:
        return errors
    generator, learner = job.generator, job.learner
    for unit, limit, others, wanted in (
            ("CPUs", cpu_limit, generator.num_generators * generator.cpus_per_generator
             + learner.num_ranks * learner.cpus_per_rank, [(i, 1.0) for i, _ in models]),
            ("GPUs", available_gpus, generator.num_generators * generator.gpus_per_generator
             + learner.num_ranks * learner.gpus_per_rank, [(i, r.gpus or 0.0) for i, r in models])):
        taken = sum(count for _, count in wanted)
        if limit is not None and taken and others <= limit < others + taken:
            index = next(i for i, count in wanted if count)
            errors.append(JobError(f"scoring.rewards.{index}.{'gpus' if unit == 'GPUs' else 'name'}",
                                   f"reward model actors take {taken:g} {unit} beside the {others:g} of generators "
                                   f"and learner ranks, but the cluster has {limit:g}"))
    return errors


def validate_job(data: Any, source: str = "job") -> Job:
    """A typed Job from parsed YAML, or JobValidationError listing every problem with its path."""
    if not isinstance(data, dict):
        raise JobValidationError(source, [JobError("(top level)", f"expected a mapping, got {type(data).__name__}")])
    try:
        job = Job.model_validate(data)
    except ValidationError as error:
        errors = _pydantic_errors(error)
        raise JobValidationError(source, errors + _cross_field_errors_without(data, error, errors)) from None
    errors = cross_field_errors(job)
    if errors:
        raise JobValidationError(source, errors)
    return job


def _cross_field_errors_without(data: dict, error: ValidationError, reported: list[JobError]) -> list[JobError]:
    """Cross-field errors of the job with its invalid fields removed (defaults stand in for them),
    so one pass reports both kinds; checks touching a field already reported are left out."""
    pruned = copy.deepcopy(data)
    for item in error.errors():
        _delete(pruned, [part for part in item["loc"] if not isinstance(part, int)])
    try:
        job = Job.model_validate(pruned)
    except ValidationError:
        return []
    seen = {e.path for e in reported}
    return [e for e in cross_field_errors(job) if e.path not in seen]


def _delete(data: Any, loc: list[Any]) -> None:
    """Remove the value at `loc`; parts that are not keys (pydantic's union tags) are skipped."""
    node, parent, last = data, None, None
    for key in loc:
        if isinstance(node, dict) and key in node:
            parent, last, node = node, key, node[key]
    if parent is not None:
        del parent[last]


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> tuple[dict[str, Any], list[JobError]]:
    """The job file's settings with `FIELD=VALUE` settings over them (`learner.steps=100`), each value read
    as YAML (`1e-6`, `true`, `[a, b]`, `{name: vcpo}`), and the overrides that could not be applied; the schema
    then checks the result like the file's own."""
    out = copy.deepcopy(data)
    errors = []
    for item in overrides:
        field, equals, raw = item.partition("=")
        if not equals or not field.strip():
            errors.append(JobError("--set", f"{item!r} is not FIELD=VALUE (for example learner.steps=100)"))
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as error:
            errors.append(JobError(field, f"--set value {raw!r} is not YAML: {getattr(error, 'problem', error)}"))
            continue
        *sections, name = field.strip().split(".")
        node = out
        for depth, section in enumerate(sections):
            node = node.setdefault(section, {})
            if not isinstance(node, dict):
                errors.append(JobError(".".join(sections[:depth + 1]),
                                       f"is a value, not a section: cannot set {field}"))
                break
        else:
            node[name] = value
    return out, errors


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> Job:
    """Read and validate a job YAML file, with `overrides` (FIELD=VALUE) over it; YAML syntax errors name the
    line."""
    path = Path(path)
    if not path.is_file():
        raise JobValidationError(str(path), [JobError("(file)", "no such file")])
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "(file)"
        raise JobValidationError(str(path),
                                 [JobError(where, f"invalid YAML: {getattr(error, 'problem', error)}")]) from None
    unapplied: list[JobError] = []
    if overrides and isinstance(data, dict):  # a file that is not a mapping is the schema's to report
        data, unapplied = apply_overrides(data, overrides)
    try:
        job = validate_job(data, str(path))
    except JobValidationError as error:
        raise JobValidationError(str(path), unapplied + error.errors) from None
    if unapplied:
        raise JobValidationError(str(path), unapplied)
    return job


def job_task(job: Job, **overrides: Any) -> Task:
    """The job's task, built from its section; `overrides` replace fields of its config (the evaluation
    set's data file)."""
    from tasks.base import build_task  # the task modules load when a task is built, not to validate a job

    return build_task(job.task.name, dataclasses.replace(section_config(job.task, TASK_CONFIGS), **overrides))


def environment_spec(job: Job) -> EnvironmentSpec | None:
    """The job's tool episodes as generators and the warm-up take them; None: one turn per response."""
    from tasks.environment import EnvironmentSpec  # standard library only, like the task configs

    e = job.environment
    if not e.tools:
        return None
    return EnvironmentSpec(tuple(e.tools), e.max_turns, e.tool_call_format, e.tool_timeout_s, e.tool_memory_limit_mb,
                           e.max_tool_output_chars, e.tool_workers, sandbox_limits(job))


def sandbox_limits(job: Job) -> SandboxLimits:
    """The job's `sandbox` section as the worker pools take it."""
    from tasks.sandbox import SandboxLimits  # standard library only

    s = job.sandbox
    return SandboxLimits(s.isolation, tuple(s.env), s.cpu_s, s.max_processes, s.max_file_mb, s.max_open_files,
                         s.max_output_chars)


def check_sandbox(job: Job, source: str = "job") -> None:
    """JobValidationError naming `sandbox.isolation` when it asks for namespaces this machine cannot start (the
    job's file alone cannot say: `validate` and `train` ask here, before anything starts)."""
    from tasks.sandbox import namespaces_unavailable

    if job.sandbox.isolation == "namespaces" and (why := namespaces_unavailable()) is not None:
        raise JobValidationError(source, [JobError("sandbox.isolation", f"namespaces cannot start on this machine: "
                                                   f"{why}; use auto or none (docs/security.md)")])


def evaluation_set(job: Job, task: Task, always: bool = False) -> list[tuple[Problem, list[dict[str, str]]]]:
    """`eval.num_problems` problems from the task's "eval" stream (of `eval.task_path`'s data when set), with
    their chat messages; empty when the job does not evaluate, unless `always` (`stableasync evaluate`)."""
    from tasks.base import TaskError

    if not (always or job.eval.every_steps or job.eval.before_training):
        return []
    if job.eval.task_path is not None:
        try:
            task = job_task(job, path=job.eval.task_path)
        except TaskError as error:
            raise TaskError(f"eval.task_path: {error}") from error
    problems = list(itertools.islice(task.problems("eval", job.seed), job.eval.num_problems))
    if not problems:
        raise TaskError(f"eval: the task {job.task.name!r} gave no evaluation problems")
    return [(problem, task.messages(problem)) for problem in problems]


@dataclasses.dataclass(frozen=True)
class EvaluationSet:
    """One set the policy answers at each evaluation, with how its answers are sampled and scored: the unnamed
    set of eval.num_problems (`name` None) logs eval/*, so earlier runs and dashboards still read; a named one
    eval/NAME/*."""

    name: str | None
    problems: list[tuple[Problem, list[dict[str, str]]]]  # with each problem's chat messages
    temperature: float
    samples_per_problem: int  # k of pass@k
    task_name: str  # the task whose verifier scores the answers, built in the reward workers from task_config
    task_config: Any
    pass_at: tuple[int, ...] = ()  # k's of the unbiased pass@k estimates (eval.pass_at)

    @property
    def label(self) -> str:
        """The set's name in `stableasync evaluate`'s table and JSON; the unnamed set is 'default'."""
        return self.name or DEFAULT_EVAL_SET

    def key(self, metric: str) -> str:
        """`metric` (an eval/* key) as this set logs it: eval/solved for the unnamed set, eval/NAME/solved else."""
        return metric if self.name is None else metric.replace("eval/", f"eval/{self.name}/", 1)


def evaluation_sets(job: Job, task: Task, always: bool = False,
                    labels: Collection[str] | None = None) -> list[EvaluationSet]:
    """Every set an evaluation answers: the unnamed one (`evaluation_set`), then each of eval.sets in the file's
    order, their files read and checked now; empty when the job does not evaluate, unless `always`. `labels`
    keeps only those sets (the unnamed one is 'default'; `stableasync evaluate --sets`)."""
    if not (always or job.eval.every_steps or job.eval.before_training):
        return []
    config = section_config(job.task, TASK_CONFIGS)
    sets = []
    if labels is None or DEFAULT_EVAL_SET in labels:
        sets.append(EvaluationSet(None, evaluation_set(job, task, always=True), job.eval.temperature,
                                  job.eval.samples_per_problem, job.task.name, config, tuple(job.eval.pass_at)))
    return sets + [_named_evaluation_set(job, name, config) for name in job.eval.sets
                   if labels is None or name in labels]


def _named_evaluation_set(job: Job, name: str, job_task_config: Any) -> EvaluationSet:
    """eval.sets.NAME read by its task format: the job's task config when the format is the job's task (its
    reward, system prompt and fields carry over), else that format's defaults; the set's file and fields on top."""
    from tasks.base import TaskError, build_task

    spec, where = job.eval.sets[name], f"eval.sets.{name}"
    if not Path(spec.path).expanduser().is_file():
        raise TaskError(f"{where}.path: no data file at {spec.path}")
    task_name = eval_set_task(job, name)
    assert task_name is not None, "validate_job refuses a set without a file format"
    fields = _config_fields(task_name)
    overrides = {"path": spec.path, **{key: value for key, value in EVAL_SET_TASK_RESETS.items() if key in fields},
                 **{key: getattr(spec, key) for key in ("prompt_field", "answer_field") if getattr(spec, key)}}
    base = job_task_config if task_name == job.task.name else TASK_CONFIGS[task_name]()
    config = dataclasses.replace(base, **overrides)
    try:
        task = build_task(task_name, config)
    except TaskError as error:
        raise TaskError(f"{where}: {error}") from error
    problems = list(itertools.islice(task.problems("eval", job.seed), spec.num_problems))
    temperature = job.eval.temperature if spec.temperature is None else spec.temperature
    return EvaluationSet(name, [(problem, task.messages(problem)) for problem in problems], temperature,
                         spec.samples_per_problem or job.eval.samples_per_problem, task_name, config,
                         tuple(job.eval.pass_at))


def dump_job(job: Job) -> str:
    """The resolved job (every default filled in) as YAML."""
    return yaml.safe_dump(job.model_dump(mode="json", by_alias=True), sort_keys=False)
