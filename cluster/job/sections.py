"""The job file's sections of the model, generation, learning, algorithm, cluster and logging: pydantic models
with `extra="forbid"`. The stabilizer and task sections are generated from the stdlib config dataclasses in
`algorithms/config.py` and `tasks/config.py`, so defaults and field docs have one source."""

from __future__ import annotations

import dataclasses
import typing
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model, model_validator

from algorithms.config import STABILIZER_CONFIGS, KLEstimator, LossAggregation
from tasks.config import TASK_CONFIGS


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

    checks: dict[str, Any] = {"dataclass_accepts": model_validator(mode="after")(dataclass_accepts)}
    return create_model(f"{config_cls.__name__}{suffix}_{name}", __base__=Section, __validators__=checks, **fields)


def _union(configs: dict[str, type], suffix: str) -> Any:
    models = tuple(_section_from_dataclass(name, cls, suffix) for name, cls in configs.items())
    return Annotated[Union[models], Field(discriminator="name")]  # noqa: UP007 - a runtime tuple


if TYPE_CHECKING:  # discriminated unions of models made at run time: their fields are read by name
    StabilizerSection = Any
    TaskSection = Any
else:
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
    dropout: float = Field(
        0.0,
        ge=0,
        le=0,
        description="dropout on the adapter's input: 0 only, since the learner "
        "runs every policy forward without dropout (a step's log-probs and ratios must come from "
        "one function, as in TRL and AReaL)",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="names of the linear layers that get an adapter (the last part of the module "
        "name); each must name a linear layer of the model",
    )


class ModelSection(Section):
    path: str = Field(
        "tiny", description="'tiny' (built offline), a known name (smollm2-135m), a local folder or a hub id"
    )
    tiny: TinyModelSection = TinyModelSection()
    sft_warmup: SFTWarmupSection = SFTWarmupSection()
    lora: LoraSection | None = Field(None, description="train a LoRA adapter only; null: full fine-tuning")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="auto: bfloat16 where the part runs on GPUs (learner ranks train it with fp32 master "
        "weights), float32 on CPU, where bf16 kernels skew log-probs",
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
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="nucleus sampling; only 1.0 (off): the learner's log-probs cannot mirror a truncated distribution",
    )
    max_model_len: int = Field(512, gt=0, description="prompt plus response tokens the engine accepts")
    kv_cache_mb: int = Field(
        64,
        gt=0,
        description="vLLM KV cache size of a CPU generator; uncapped it takes most "
        "of RAM. A GPU generator sizes its cache by gpu_memory_utilization",
    )
    gpu_memory_utilization: float = Field(
        0.85,
        gt=0,
        le=1,
        description="share of each GPU a GPU generator's vLLM takes for weights, activations and "
        "KV cache; lower it when something else shares the GPU",
    )
    tensor_parallel_size: int = Field(
        1,
        gt=0,
        description="GPUs one generator's engine shards the model over: a placement group of that many "
        "GPU bundles on one node, vLLM's ray executor. gpus_per_generator must equal it",
    )
    cuda_graphs: bool = Field(
        True, description="capture CUDA graphs for decoding (GPU generators); off runs eager, slower, for debugging"
    )
    prefix_caching: bool = Field(
        True,
        description="reuse the KV blocks of a prompt that a group's samples share "
        "(GPU generators; the cache is reset at every weight load)",
    )
    max_num_seqs: int | None = Field(
        None, gt=0, description="sequences a GPU engine decodes at once; none: vLLM's default"
    )
    max_restarts: int = Field(
        3, ge=0, description="times a dead generator process is restarted; its in-flight groups are issued again"
    )
    max_generators: int | None = Field(
        None,
        gt=0,
        description="elastic: while the job runs, start a generator on every free unit of cluster.generator_resource "
        "(nodes the autoscaler adds) up to this many, and carry on without generators whose node left; "
        "none keeps num_generators fixed",
    )
    streaming: bool = Field(
        False,
        description="run each generator as a streaming engine (vLLM's AsyncLLM): several generate calls "
        "at once, and new weights loaded while requests are in flight, each token labelled with the policy version "
        "that sampled it (a group's lag counts from its oldest token)",
    )
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
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="RL steps over which the learning rate ramps up linearly to "
        "learning_rate (the SFT warm-up has its own rate)",
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="after the warm-up: constant, or a linear or cosine decay to "
        "lr_min_ratio x learning_rate at the last step",
    )
    lr_min_ratio: float = Field(
        0.0, ge=0, le=1, description="where a linear or cosine decay ends, as a fraction of learning_rate"
    )
    weight_decay: float = Field(0.0, ge=0)
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon; larger values damp steps of near-zero gradients")
    grad_clip: float = Field(1.0, gt=0)
    max_tokens_per_micro_batch: Annotated[int | Literal["auto"], BeforeValidator(_token_budget)] = Field(
        "auto",
        description="tokens a rank runs through the model at once (real tokens in a packed micro-batch, "
        "rows x longest row in a padded one); a step "
        "accumulates as many micro-batches as its batch needs, with the same update. auto: what the memory left "
        "on the rank's device holds, from the model's size (the run's log gives each rank's choice and why); a "
        "number: at least generator.max_model_len, lower when a step runs out of memory",
    )
    gradient_checkpointing: bool = Field(
        False,
        description="recompute each layer's activations in the backward: less memory, about a third "
        "more compute per step",
    )
    packed_micro_batches: bool = Field(
        True,
        description="run each micro-batch's rows as one sequence without padding (position ids restarting "
        "per row, attention within each row: flash-attn's or PyTorch's varlen kernel on a GPU, else SDPA per row), "
        "so its budget counts real tokens, VCPO's steps included. false: right-padded rows",
    )
    fused_output_layer: bool = Field(
        True,
        description="run the output layer and the log-softmax together one chunk of positions (or, for VCPO's "
        "per-sample norms, of the vocabulary) at a time, so no [tokens, vocabulary] logits are formed, where a "
        "probe at start-up finds the model's logits are h W^T (not under ZeRO-3). false: the model's own logits",
    )
    compile: Literal["none", "layers"] = Field(
        "none",
        description="layers: each decoder layer compiled in place by torch.compile (one graph serves every layer; "
        "the packed attention stays outside it), so a step makes far fewer operator calls; costs about a "
        "layer's compile time at the first step. Not with per-sample gradient norms (VCPO's baseline) or ZeRO-3",
    )
    compile_backend: Literal["inductor", "aot_eager"] = Field(
        "inductor",
        description="learner.compile's torch.compile backend: inductor generates fused kernels (Triton on a GPU, "
        "C++ on the CPU, which needs a compiler); aot_eager traces and differentiates without generating any, "
        "to tell a problem in inductor from one in tracing",
    )
    max_restarts: int = Field(
        2, ge=0, description="times the job resumes by itself from its latest checkpoint after a learner rank dies"
    )
    max_skipped_steps_in_a_row: int = Field(
        5, gt=0, description="consecutive steps skipped for non-finite values before the job stops (with a checkpoint)"
    )
    mini_batches: int = Field(
        1,
        gt=0,
        description="optimizer updates per pass over a step's batch, each on its own share of the prompt "
        "groups (PPO's mini-batches); more than one needs algorithm.proximal: recompute",
    )
    epochs: int = Field(
        1, gt=0, description="passes over a step's batch; more than one needs algorithm.proximal: recompute"
    )
    cpus_per_rank: float = Field(1.0, gt=0)
    gpus_per_rank: float = Field(0.0, ge=0)


class KLSection(Section):
    """A KL term to the frozen initial policy (verl's kl loss or kl in reward, OpenRLHF's init_kl_coef, TRL's
    beta): the reference's log-probs come from a second copy of the starting model on the learner ranks."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    coef: float = Field(0.001, gt=0, description="weight of the KL term (the starting value with `target`)")
    estimator: KLEstimator = Field(
        "low_var+",
        description="per-token estimator of KL(policy || reference) from l = log pi - log ref: k1 = l, "
        "k2 = l^2 / 2, k3 = exp(-l) - 1 + l, low_var = k3 bounded to [-10, 10] (verl's low_var_kl); k3+ and "
        "low_var+ have k3's and low_var's value with k2's gradient. In the loss only k2, k3+ and low_var+ follow "
        "the gradient of KL(policy || reference): k3 and low_var follow KL(reference || policy)'s, and k1 "
        "(refused there) has none",
    )
    in_: Literal["loss", "reward"] = Field(
        "loss",
        alias="in",
        description="loss: coef x the aggregated token KL is added to the loss (GRPO's way); "
        "reward: coef x each response's summed KL, from its behaviour log-probs, is subtracted from its reward "
        "before the advantages (PPO's way)",
    )
    target: float | None = Field(
        None,
        gt=0,
        description="adaptive coefficient: after each step the coefficient moves towards keeping "
        "stability/kl_ref_mean (per token) at this value, by at most 20% of the gap per `horizon` sequences",
    )
    horizon: int = Field(10000, gt=0, description="adaptive coefficient: sequences over which it may move by 20%")
    reference: Literal["rl_start", "model"] = Field(
        "rl_start",
        description="the policy the KL measures against: rl_start, the policy RL starts from (after "
        "model.sft_warmup, which is written to RUN_DIR/reference and loaded from there; verl's and OpenRLHF's "
        "reference), or model, model.path as it loads (before any warm-up)",
    )


class AlgorithmSection(Section):
    stabilizer: StabilizerSection = Field(default_factory=lambda: {"name": "tis_seq"}, validate_default=True)
    advantage: Literal["grpo", "dr_grpo", "reinforce", "rloo"] = "grpo"
    loss_aggregation: LossAggregation = "token-mean"
    proximal: Literal["behaviour", "recompute"] = Field(
        "behaviour",
        description="the decoupled objective (AReaL): recompute takes the learner's own log-probs at "
        "the start of each step (one no-grad pass) as the proximal policy. The stabilizer corrects the staleness "
        "against it, and each of the step's updates (learner.mini_batches x learner.epochs) is clipped to "
        "proximal_eps_low/high around it. behaviour: one update, the stabilizer against the behaviour policy",
    )
    proximal_eps_low: float = Field(
        0.2,
        gt=0,
        lt=1,
        description="recompute: ratios pi/pi_prox below 1 - eps_low get no gradient where the advantage is negative",
    )
    proximal_eps_high: float = Field(
        0.2,
        gt=0,
        description="recompute: ratios pi/pi_prox above 1 + eps_high get no gradient where the advantage is positive",
    )
    constant_tokens: int | None = Field(None, gt=0, description="the constant length of `constant` aggregation")
    kl: KLSection | None = Field(None, description="a KL term to the frozen starting policy; null: none")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="entropy bonus: the loss loses this times the aggregated token entropy of the policy "
        "(from the same chunked log-softmax as the log-probs); 0: off",
    )
    drop_uniform_groups: bool = Field(
        False,
        description="DAPO's dynamic sampling: a prompt group whose responses all scored the same (all solved "
        "or all failed, so every advantage is 0) is dropped when scored, in the ledger with why, and the generators "
        "sample another in its place: each step trains prompts_per_step groups that carry a learning signal",
    )
    overlong_buffer_tokens: int = Field(
        0,
        ge=0,
        description="DAPO's soft overlong punishment: over the last N tokens before generator.max_new_tokens, "
        "a response's reward falls linearly, down to -overlong_penalty at the cap; 0: off",
    )
    overlong_penalty: float = Field(
        1.0,
        ge=0,
        description="the reward a response reaching generator.max_new_tokens loses (with overlong_buffer_tokens)",
    )
    max_uniform_groups_in_a_row: int = Field(
        256,
        gt=0,
        description="with drop_uniform_groups: after this many groups in a row are dropped so, the job "
        "stops with a checkpoint (the policy solves each problem it draws always or never: the task is too easy or "
        "too hard for it, or it stopped exploring)",
    )


class AsyncSection(Section):
    max_lag: int = Field(
        1, ge=0, description="learner version minus rollout version allowed at train time; 0 is on-policy"
    )
    stale_policy: Literal["wait", "drop"] = Field(
        "wait", description="wait: generators pause so nothing goes stale; drop: stale groups are dropped (ledger)"
    )
    fixed_lag: int | None = Field(
        None,
        ge=0,
        description="train every group exactly this many versions stale (the first fixed_lag + 1 steps train the "
        "initial policy's groups), as the M2PO paper's experiments do; needs max_lag at least as large; "
        "null: as stale as asynchrony makes it, up to max_lag",
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
        None,
        description="custom node resource every generator takes one unit of ('generator' on the deploy "
        "YAMLs' generator nodes); none: any node with the CPUs/GPUs",
    )
    learner_resource: str | None = Field(
        None,
        description="custom node resource every learner rank takes one unit of ('learner' on the deploy "
        "YAMLs' learner nodes); none: any node",
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
        0.1,
        ge=0,
        le=1,
        description="ESS collapse: stability/ess_ratio below this (or NaN) for ess_collapse_steps "
        "steps in a row; null: no ESS alert",
    )
    ess_collapse_steps: int = Field(3, gt=0, description="consecutive low-ESS steps that make a collapse")
    entropy_below: float | None = Field(
        None,
        ge=0,
        description="entropy collapse: stability/entropy (nats per token) below this (or NaN) for "
        "entropy_collapse_steps steps in a row; null: no entropy alert (a sensible value depends on the task)",
    )
    entropy_collapse_steps: int = Field(5, gt=0, description="consecutive low-entropy steps that make a collapse")
    grad_norm_above: float | None = Field(
        None,
        gt=0,
        description="gradient-norm spike: optim/grad_norm above this absolute value; null: no absolute limit",
    )
    grad_norm_spike_factor: float | None = Field(
        10.0,
        gt=1,
        description="gradient-norm spike: optim/grad_norm above this times the median of the previous "
        "grad_norm_window_steps steps; null: no relative rule (a NaN norm is a spike while either rule is on)",
    )
    grad_norm_window_steps: int = Field(
        20, gt=0, description="steps in the running median of the relative rule; it applies once that many are seen"
    )
    zero_std_share_above: float | None = Field(
        0.9,
        ge=0,
        lt=1,
        description="no learning signal: rollout/zero_std_share (trained responses whose group scored every "
        "response the same) above this for zero_std_steps steps in a row; null: no such alert",
    )
    zero_std_steps: int = Field(10, gt=0, description="consecutive mostly-flat steps that make the alert")


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
    engine_logs: bool = Field(
        False,
        description="the actors' engine logs on the console (vLLM's start-up and warnings, transformers' progress "
        "bars, Python warnings); off: their errors only (Ray keeps every actor's whole log in its session folder)",
    )
    alerts: AlertsSection = AlertsSection()
    samples: SamplesSection = SamplesSection()


class CheckpointSection(Section):
    every_steps: int = Field(0, ge=0, description="checkpoint every N steps and at the last; 0: none")
    keep: int = Field(2, gt=0)
    save_model: bool = Field(
        True,
        description="write the trained policy to RUN_DIR/model at the end of the run, "
        "as a Hugging Face model folder (safetensors, config, tokenizer)",
    )
    stop_grace_s: int = Field(
        300,
        gt=0,
        description="seconds `stableasync stop` gives a submitted job to finish its learner step and "
        "write its checkpoint before Ray kills it (RAY_JOB_STOP_WAIT_TIME_S; Ray's own default is 3)",
    )
