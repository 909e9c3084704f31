"""The job's actors' specs: what the learner ranks and generators are built from, derived from a validated
job. Ray-free, so the driver, the reference loop, `stableasync evaluate` and the benchmarks share them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actors.buffer import FixedLag, Ledger, RolloutBuffer
from actors.generator import GeneratorSpec
from algorithms.config import STABILIZER_CONFIGS
from cluster.job import Job, KLSection, environment_spec, section_config
from learner.lora import LoraSpec
from learner.rank import LearnerSpec


def lora_spec(job: Job) -> LoraSpec | None:
    """The learner's and generators' LoraSpec of the job's model.lora (None: full fine-tuning)."""
    lora = job.model.lora
    return None if lora is None else LoraSpec(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules))


def rollout_buffer(job: Job, ledger: Ledger) -> RolloutBuffer:
    """The run's rollout buffer: the job's lag bound or fixed lag, stale policy and which groups it keeps."""
    lag, learner = job.async_.fixed_lag, job.learner
    return RolloutBuffer(
        job.async_.max_lag,
        learner.prompts_per_step,
        job.async_.stale_policy,
        ledger,
        job.algorithm.drop_uniform_groups,
        job.environment.train_failed_episodes,
        None if lag is None else FixedLag(lag, learner.prompts_per_step, learner.steps),
    )


def reference_at_rl_start(job: Job) -> bool:
    """Whether the KL reference is the policy after the SFT warm-up (algorithm.kl.reference rl_start)."""
    kl = job.algorithm.kl
    return kl is not None and kl.reference == "rl_start" and job.model.sft_warmup.steps > 0 and job.model.lora is None


def learner_spec(job: Job, model_path: str, reference: Path | None = None) -> LearnerSpec:
    """The learner ranks' spec; `reference`: RUN_DIR/reference, the KL reference as RL starts, used
    when it was written (a resumed run)."""
    stabilizer = job.algorithm.stabilizer
    return LearnerSpec(
        model_path=model_path,
        zero_stage=job.learner.zero_stage,
        learning_rate=job.learner.learning_rate,
        total_steps=job.learner.steps,
        lr_warmup_steps=job.learner.lr_warmup_steps,
        lr_schedule=job.learner.lr_schedule,
        lr_min_ratio=job.learner.lr_min_ratio,
        weight_decay=job.learner.weight_decay,
        adam_eps=job.learner.adam_eps,
        grad_clip=job.learner.grad_clip,
        temperature=job.generator.temperature,
        stabilizer_name=stabilizer.name,
        stabilizer_config=section_config(stabilizer, STABILIZER_CONFIGS),
        advantage=job.algorithm.advantage,
        loss_aggregation=job.algorithm.loss_aggregation,
        constant_tokens=job.algorithm.constant_tokens,
        dtype=job.model.dtype_on(gpu=job.learner.gpus_per_rank > 0),
        seed=job.seed,
        backend="nccl" if job.learner.gpus_per_rank else "gloo",
        max_tokens_per_micro_batch=job.learner.max_tokens_per_micro_batch,
        max_sequence_tokens=job.generator.max_model_len,
        device_share=min(1.0, job.learner.gpus_per_rank or 1.0),
        gradient_checkpointing=job.learner.gradient_checkpointing,
        packed_micro_batches=job.learner.packed_micro_batches,
        fused_output_layer=job.learner.fused_output_layer,
        compiled_layers=job.learner.compile_backend if job.learner.compile == "layers" else None,
        proximal=job.algorithm.proximal,
        proximal_eps_low=job.algorithm.proximal_eps_low,
        proximal_eps_high=job.algorithm.proximal_eps_high,
        mini_batches=job.learner.mini_batches,
        epochs=job.learner.epochs,
        **kl_values(job.algorithm.kl),
        entropy_coef=job.algorithm.entropy_coef,
        lora=lora_spec(job),
        reference_path=(
            str(reference)
            if reference is not None and reference_at_rl_start(job) and (reference / "config.json").is_file()
            else None
        ),
    )


def kl_values(kl: KLSection | None) -> dict[str, Any]:
    """The LearnerSpec fields of the job's KL term (none: coefficient 0, no reference model)."""
    if kl is None:
        return {}
    return {
        "kl_coef": kl.coef,
        "kl_estimator": kl.estimator,
        "kl_in": kl.in_,
        "kl_target": kl.target,
        "kl_horizon": kl.horizon,
    }


# async.weight_sync -> the vLLM weight-transfer engine that loads the weights in each generator
WEIGHT_TRANSFER_ENGINES = {"object_store": "stableasync_packed", "gloo": "stableasync_gloo", "nccl": "nccl"}


def generator_spec(job: Job, model_path: str) -> GeneratorSpec:
    """A generator's spec (every generator of a job has the same)."""
    g = job.generator
    return GeneratorSpec(
        model_path=model_path,
        samples_per_prompt=g.samples_per_prompt,
        max_new_tokens=g.max_new_tokens,
        temperature=g.temperature,
        top_p=g.top_p,
        max_model_len=g.max_model_len,
        kv_cache_mb=g.kv_cache_mb,
        dtype=job.model.dtype_on(gpu=g.gpus_per_generator > 0),
        seed=job.seed,
        gpus=g.gpus_per_generator,
        tensor_parallel_size=g.tensor_parallel_size,
        gpu_memory_utilization=g.gpu_memory_utilization,
        cuda_graphs=g.cuda_graphs,
        prefix_caching=g.prefix_caching,
        max_num_seqs=g.max_num_seqs,
        weight_transfer=WEIGHT_TRANSFER_ENGINES[job.async_.weight_sync],
        streaming=g.streaming,
        lora=lora_spec(job),
        environment=environment_spec(job),
    )
