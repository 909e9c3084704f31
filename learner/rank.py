"""One DeepSpeed ZeRO learner rank: learner log-probs, the stabilized step, weight publishing.

A plain class: `cluster/` runs one per Ray actor. Every rank of a group runs every collective method
(`train_step`, `sft_step`, `state_dict_for_publish`) with its own share of the prompt groups.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from algorithms import registry
from algorithms.advantages import ADVANTAGES, group_mean_advantages
from algorithms.aggregation import loss_denominator, policy_loss
from algorithms.batch import PolicyBatch
from algorithms.diagnostics import chi2_seq, ess_ratio, health_metrics
from learner.batch import TrainBatch, sequence_logprob_grad, token_entropy, token_logprobs
from learner.grad_norms import GhostGradNorms, SampleGradients, UncoveredParameters, per_sample_loop_norms
from learner.lr_schedule import LRSchedule, lr_factor
from learner.weight_sync import PackedWeights

log = logging.getLogger("stableasync.learner")


GLOBAL_METRICS = {"stability/ess_ratio", "stability/chi2_seq", "stability/ess_ratio_clipped", "stability/lr_scale",
                  "stability/skipped_step"}


def sequence_metrics(global_log_w: Tensor) -> dict[str, Tensor]:
    """ESS ratio and sequence chi-square over the whole global batch (every rank's sequences)."""
    if global_log_w.numel() == 0:
        return {}
    return {"stability/ess_ratio": ess_ratio(global_log_w), "stability/chi2_seq": chi2_seq(global_log_w)}


@dataclass(frozen=True)
class LearnerSpec:
    """Everything a rank needs, as plain values (the job schema stays on the driver)."""

    model_path: str
    zero_stage: int = 2
    learning_rate: float = 1e-6
    total_steps: int = 1
    lr_warmup_steps: int = 0
    lr_schedule: LRSchedule = "constant"
    lr_min_ratio: float = 0.0
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    grad_clip: float = 1.0
    temperature: float = 1.0
    stabilizer_name: str = "tis_seq"
    stabilizer_config: Any = None
    advantage: str = "grpo"
    loss_aggregation: str = "token-mean"
    constant_tokens: int | None = None
    dtype: str = "float32"
    seed: int = 0
    backend: str = "gloo"


def check_owned_by_me(path: Path) -> None:
    """Refuse a checkpoint folder that holds anything another user owns or can write: loading it unpickles
    its files, and a pickle can run code."""
    for item in [path, *path.rglob("*")]:
        info = item.lstat()
        if info.st_uid != os.getuid():
            raise PermissionError(f"refusing to load checkpoint {path}: {item} belongs to another user (uid {info.st_uid})")
        if info.st_mode & 0o002:
            raise PermissionError(f"refusing to load checkpoint {path}: {item} is writable by every user")


@contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Any failure while writing `what` comes out as an OSError, which the driver treats as storage trouble
    (an alert for a checkpoint, a reported model error): a full disk surfaces from torch.save as a
    RuntimeError ("unexpected pos") and from safetensors as a SafetensorError, neither an OSError."""
    try:
        yield
    except OSError:
        raise
    except Exception as error:  # noqa: BLE001 - reported with its type and message, never swallowed
        raise OSError(f"writing {what} failed: {type(error).__name__}: {error}") from error


def save_model_folder(model: Any, tokenizer_source: str, folder: str) -> None:
    """`model` and the tokenizer of `tokenizer_source` as a Hugging Face folder that transformers and vLLM
    load as it is; any failure to write it is an OSError (`storage_errors`)."""
    from transformers import AutoTokenizer

    with storage_errors(f"the model folder {folder}"):
        model.save_pretrained(folder, safe_serialization=True)
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(folder)
    if not (Path(folder) / "config.json").is_file() or not any(Path(folder).glob("*.safetensors")):
        # save_pretrained only logs, and returns, when `folder` is not a directory it can use
        raise NotADirectoryError(f"{folder}: save_pretrained wrote no config.json and weights there")


class LearnerRank:
    """A ZeRO data-parallel rank of the policy."""

    def __init__(self, spec: LearnerSpec, rank: int, world_size: int, master_addr: str, master_port: int) -> None:
        import deepspeed
        from transformers import AutoModelForCausalLM

        os.environ.update(
            MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_RANK="0" if spec.backend == "gloo" else os.environ.get("LOCAL_RANK", "0"),
        )
        deepspeed.init_distributed(dist_backend=spec.backend)
        torch.manual_seed(spec.seed)
        self.spec, self.rank, self.world_size = spec, rank, world_size
        dtype = torch.float32 if spec.dtype == "float32" else torch.bfloat16
        model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=dtype)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "optimizer": {
                "type": "AdamW",
                "params": {"lr": spec.learning_rate, "weight_decay": spec.weight_decay, "eps": spec.adam_eps,
                           "torch_adam": True},
            },
            "zero_optimization": {"stage": spec.zero_stage},
            "gradient_clipping": spec.grad_clip,
            "bf16": {"enabled": spec.dtype == "bfloat16"},
            "steps_per_print": 10**9,
        }
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        self.stabilizer = registry.build(spec.stabilizer_name, **_config_values(spec.stabilizer_config))
        self.advantage_fn = ADVANTAGES[spec.advantage]
        # a stabilizer without the option (a user's own) gets the ghost path
        opob_impl = getattr(self.stabilizer.config, "opob_impl", "ghost")
        self.ghost_norms, self.grad_norm_fallback = self._ghost_norms(opob_impl)
        self.bookkeeping = self._uses_bookkeeping(opob_impl)
        self.version = 0

    def _ghost_norms(self, opob_impl: str) -> tuple[GhostGradNorms | None, bool]:
        """The ghost-norm path when the stabilizer needs per-sample norms and every parameter has a rule;
        otherwise the per-sample loop, announced (a silent 10x slowdown would look like a hang)."""
        if not self.stabilizer.needs_grad_norms or opob_impl == "per_sample_loop":
            return None, False
        try:
            return GhostGradNorms(self.engine.module), False
        except UncoveredParameters as error:
            log.warning("learner rank %d: per-sample gradient norms fall back to one backward per sample: %s",
                        self.rank, error)
            return None, True

    def _uses_bookkeeping(self, opob_impl: str) -> bool:
        """Book-keeping forms the update from the kept per-sample gradients, which needs whole parameters:
        under ZeRO-3 the norms come from the two-pass ghost path instead (said once, here)."""
        if self.ghost_norms is None or opob_impl != "bookkeeping":
            return False
        if self.spec.zero_stage == 3:
            log.info("learner rank %d: ZeRO-3 partitions the parameters, so per-sample norms use the two-pass "
                     "ghost path instead of bookkeeping", self.rank)
            return False
        return True

    # ---- the RL step -------------------------------------------------------------------------

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's groups; returns metrics averaged over ranks."""
        start = time.perf_counter()
        self.engine.train()
        # ZeRO-3 takes its norms from a forward of its own (_ghost_norms_own_forward), not this one
        record = self.ghost_norms is not None and self.spec.zero_stage != 3
        with self.ghost_norms.recording() if record else nullcontext():
            logits = self._logits(batch, plain=self.bookkeeping)  # no loss backward through the engine follows
        logprobs = token_logprobs(logits, batch.input_ids, self.spec.temperature)
        sample_grads = self._sample_gradients(batch, logits) if self.stabilizer.needs_grad_norms else None
        advantages, baseline_metrics = self._advantages(batch, logprobs, sample_grads)
        policy = PolicyBatch(logprobs, batch.behaviour_logprobs, advantages, batch.loss_mask)
        decision = self.stabilizer.token_weights(policy)
        metrics = {**health_metrics(policy), **decision.metrics, **baseline_metrics}
        entropy = token_entropy(logits, self.spec.temperature) * batch.loss_mask
        metrics["stability/entropy"] = entropy.sum() / batch.loss_mask.sum().clamp(min=1)

        denominator = self._all_reduce_sum(loss_denominator(decision.mask, self.spec.loss_aggregation, self.spec.constant_tokens))
        loss = policy_loss(policy, decision, self.spec.loss_aggregation, denominator, self.spec.constant_tokens)
        global_log_w = self._all_gather(policy.seq_log_ratio[policy.token_lengths > 0])
        metrics.update(sequence_metrics(global_log_w))
        metrics.update(self.stabilizer.global_metrics(global_log_w))
        if not self._all_finite(loss, decision.weights):
            self.engine.zero_grad()
            metrics["optim/lr"] = torch.tensor(0.0)
            return self._finish(metrics, start, skipped=True, loss=loss, lr_scale=0.0, grad_norm=math.nan, batch=batch)

        lr_scale = self.stabilizer.lr_scale(global_log_w)
        self._backward(loss, logprobs, sample_grads, batch.loss_mask)
        schedule = lr_factor(self.version, self.spec.total_steps, self.spec.lr_warmup_steps, self.spec.lr_schedule,
                             self.spec.lr_min_ratio)
        metrics["optim/lr"] = torch.tensor(self.spec.learning_rate * schedule * lr_scale)
        grad_norm = self._step_with_lr_scale(lr_scale * schedule)
        return self._finish(metrics, start, skipped=False, loss=loss, lr_scale=lr_scale, grad_norm=grad_norm, batch=batch)

    def _backward(self, loss: Tensor, logprobs: Tensor, sample_grads: SampleGradients | None, loss_mask: Tensor) -> None:
        """Gradients of the loss into the engine. DeepSpeed averages over ranks, so each rank's loss is
        its share of the global sum.

        With book-keeping the loss is sum_i k_i log pi(tau_i) (VCPO's weights and advantages are per
        sequence), so its gradient is sum_i k_i G_i of the kept per-sample gradients G_i; the engine's
        backward of <theta, that gradient> hands it to ZeRO's reduction without a pass through the model.
        """
        loss = loss * self.world_size
        if sample_grads is None or sample_grads.parts is None:
            self.engine.backward(loss)
            return
        (token_coefficients,) = torch.autograd.grad(loss, logprobs)
        grads = sample_grads.weighted_sum(per_sequence_coefficients(token_coefficients, loss_mask))
        self.engine.backward(sum((param * grad).sum() for param, grad in grads.items()))

    def _advantages(self, batch: TrainBatch, logprobs: Tensor, sample_grads: SampleGradients | None
                    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The stabilizer's own advantages (VCPO's baseline), else the job's estimator; with baseline metrics."""
        log_w = ((logprobs.detach() - batch.behaviour_logprobs) * batch.loss_mask).sum(dim=1)
        lengths = batch.loss_mask.sum(dim=1).float()
        grad_sq_norms = None if sample_grads is None else sample_grads.squared_norms
        own = self.stabilizer.advantages(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)
        if own is None:
            return self.advantage_fn(batch.rewards, batch.group_ids), {}
        if grad_sq_norms is None:
            return own, {}
        baseline = self.stabilizer.baseline(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)
        group_mean = batch.rewards - group_mean_advantages(batch.rewards, batch.group_ids)
        norms = self._all_gather(grad_sq_norms).sqrt()
        return own, {
            "opob/baseline_mean": baseline.mean(),
            "opob/group_mean_baseline_mean": group_mean.mean(),
            "opob/baseline_shift_abs": (baseline - group_mean).abs().mean(),
            "opob/sample_grad_norm_mean": norms.mean(),
            "opob/sample_grad_norm_median": norms.median(),
            "opob/sample_grad_norm_max": norms.max(),
            "opob/fallback_to_loop": torch.tensor(float(self.grad_norm_fallback)),
        }

    def _sample_gradients(self, batch: TrainBatch, logits: Tensor) -> SampleGradients:
        """||grad log pi(tau_i)||^2 of each of this rank's sequences (with book-keeping, the per-sample
        gradients too); otherwise the graph stays for the loss backward."""
        if self.ghost_norms is not None and self.spec.zero_stage == 3:
            return SampleGradients(self._ghost_norms_own_forward(batch))
        if self.ghost_norms is not None:
            logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, self.spec.temperature)
            if self.bookkeeping:
                return self.ghost_norms.sample_gradients(logits_grad)
            return SampleGradients(self.ghost_norms.squared_norms(logits_grad))

        def sample_logp(i: int) -> Tensor:  # the plain module: the engine's backward hooks stay out of it
            row = batch.rows(torch.tensor([i]))
            row_logits = self._logits(row, plain=True)
            return (token_logprobs(row_logits, row.input_ids, self.spec.temperature) * row.loss_mask).sum()

        params = [p for p in self.engine.module.parameters() if p.requires_grad]
        return SampleGradients(per_sample_loop_norms(sample_logp, batch.size, params))

    def _ghost_norms_own_forward(self, batch: TrainBatch) -> Tensor:
        """ZeRO-3: its module hooks gather and release parameters per backward and need each backward
        to enter at the model's top, so the ghost pass gets a forward of its own (one extra forward)."""
        with self.ghost_norms.recording():
            logits = self._logits(batch, plain=True)
        logits_grad = sequence_logprob_grad(logits, batch.input_ids, batch.loss_mask, self.spec.temperature)
        return self.ghost_norms.squared_norms(logits_grad, from_logits=True)

    def sft_step(self, batch: TrainBatch, learning_rate: float) -> dict[str, float]:
        """Supervised warm-up on demonstrations: token-mean cross-entropy of the completion tokens."""
        self.engine.train()
        logprobs = self.log_probs(batch, grad=True)
        mask = batch.loss_mask.float()
        denominator = self._all_reduce_sum(mask.sum())
        loss = -(logprobs * mask).sum() / denominator.clamp(min=1)
        self.engine.backward(loss * self.world_size)
        grad_norm = self._step_with_lr_scale(learning_rate / self.spec.learning_rate)
        metrics = {"sft/loss": loss.detach(), "sft/grad_norm": torch.tensor(grad_norm)}
        return self._reduce_metrics(metrics)

    def log_probs(self, batch: TrainBatch, grad: bool = False) -> Tensor:
        """Learner log-probs of each next token at the generator's temperature, [B, L-1]."""
        with torch.set_grad_enabled(grad):
            return token_logprobs(self._logits(batch), batch.input_ids, self.spec.temperature)

    def _logits(self, batch: TrainBatch, plain: bool = False) -> Tensor:
        """[B, L, V] logits; `plain` runs the bare module, outside the engine's backward bookkeeping."""
        model = self.engine.module if plain else self.engine
        return model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits

    def packed_weights_for_publish(self) -> PackedWeights | None:
        """Full fp32 weights in HF checkpoint names, copied once into one buffer for the generators (rank 0;
        None on the other ranks). A collective under ZeRO-3."""
        module = self.engine.module
        if self.spec.zero_stage == 3:
            import deepspeed

            weights = {}
            for name, param in module.named_parameters():
                with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
                    weights[name] = param.detach().float().clone()
        else:
            weights = {name: tensor.detach().float() for name, tensor in module.state_dict().items()}
        return PackedWeights.pack(weights) if self.rank == 0 else None

    def state_dict_for_publish(self) -> dict[str, Tensor]:
        """`packed_weights_for_publish` as a name -> tensor dict (a copy; empty off rank 0)."""
        packed = self.packed_weights_for_publish()
        return packed.tensors() if packed is not None else {}

    def save_model(self, folder: str) -> None:
        """The policy as a Hugging Face model folder (config, safetensors, tokenizer) that transformers and
        vLLM load as they are; rank 0 writes it. A collective under ZeRO-3, which gathers the parameters."""
        module = self.engine.module
        gathered = nullcontext()
        if self.spec.zero_stage == 3:
            import deepspeed

            gathered = deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None)
        with gathered:
            if self.rank == 0:
                save_model_folder(module, self.spec.model_path, folder)

    # ---- checkpoints -------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, tag: str) -> None:
        """Model, optimizer (each rank its ZeRO shard), policy version and RNG state; a collective."""
        client_state = {"version": self.version, "torch_rng": torch.get_rng_state()}
        with storage_errors(f"learner rank {self.rank}'s checkpoint to {directory}"):
            self.engine.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)

    def load_checkpoint(self, directory: str, tag: str) -> int:
        """Restore what `save_checkpoint` wrote; returns the policy version. A collective."""
        path = Path(directory) / tag
        check_owned_by_me(path)  # DeepSpeed unpickles its checkpoint files
        loaded, client_state = self.engine.load_checkpoint(directory, tag=tag, load_optimizer_states=True,
                                                            load_lr_scheduler_states=True)
        if loaded is None:
            raise FileNotFoundError(f"learner rank {self.rank}: no checkpoint in {path}")
        self.version = int(client_state["version"])
        torch.set_rng_state(client_state["torch_rng"])
        return self.version

    # ---- helpers -----------------------------------------------------------------------------

    def _step_with_lr_scale(self, lr_scale: float) -> float:
        """optimizer.step at lr * lr_scale for this step only, then the base LR is restored."""
        groups = self.optimizer.param_groups
        base = [group["lr"] for group in groups]
        for group in groups:
            group["lr"] = group["lr"] * lr_scale
        try:
            self.engine.step()
        finally:
            for group, lr in zip(groups, base):
                group["lr"] = lr
        self.version += 1
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else math.nan

    def _finish(self, metrics: dict[str, Tensor], start: float, *, skipped: bool, loss: Tensor, lr_scale: float,
                grad_norm: float, batch: TrainBatch) -> dict[str, float]:
        metrics = dict(metrics)
        metrics["optim/loss"] = loss.detach() * self.world_size  # a share of the global loss; ranks average
        metrics["optim/grad_norm"] = torch.tensor(grad_norm)
        metrics["stability/lr_scale"] = torch.tensor(lr_scale)
        metrics["stability/skipped_step"] = torch.tensor(float(skipped))
        metrics["rollout/reward_mean"] = batch.rewards.mean()
        metrics["rollout/response_len"] = batch.loss_mask.float().sum(1).mean()
        metrics["time/learner_step_s"] = torch.tensor(time.perf_counter() - start)
        metrics["perf/learner_tokens_per_s"] = batch.attention_mask.sum() / metrics["time/learner_step_s"]
        return self._reduce_metrics(metrics, token_weight=batch.loss_mask.sum())

    def _reduce_metrics(self, metrics: dict[str, Tensor], token_weight: Tensor | None = None) -> dict[str, float]:
        """Average over ranks: `stability/` token statistics weighted by each rank's loss tokens (so
        they equal the global token mean), everything else plainly (ranks hold equal sample counts).
        Sequence statistics computed from the gathered global batch are the same on every rank."""
        names = sorted(metrics)
        values = torch.stack([metrics[name].detach().float().reshape(()) for name in names])
        if self.world_size == 1:
            return dict(zip(names, values.tolist()))
        weights = torch.ones_like(values)
        if token_weight is not None:
            weighted = torch.tensor([n.startswith("stability/") and n not in GLOBAL_METRICS for n in names])
            weights[weighted] = token_weight.float()
        totals = torch.stack([values * weights, weights])
        dist.all_reduce(totals)
        return dict(zip(names, (totals[0] / totals[1]).tolist()))

    def _all_reduce_sum(self, value: Tensor) -> Tensor:
        value = value.detach().float().clone()
        if self.world_size > 1:
            dist.all_reduce(value)
        return value

    def _all_finite(self, *tensors: Tensor) -> bool:
        """Whether every rank's tensors are finite: a collective, so all ranks skip together."""
        bad = torch.tensor(float(sum(int(not torch.isfinite(t.detach()).all()) for t in tensors)))
        return self._all_reduce_sum(bad).item() == 0

    def _all_gather(self, values: Tensor) -> Tensor:
        """Concatenate a 1-D tensor of possibly different lengths from every rank."""
        values = values.detach().float()
        if self.world_size == 1:
            return values
        size = torch.tensor([values.numel()], dtype=torch.long)
        sizes = [torch.zeros_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size)
        width = int(max(s.item() for s in sizes))
        padded = torch.zeros(width)
        padded[: values.numel()] = values
        gathered = [torch.zeros(width) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return torch.cat([g[: int(s.item())] for g, s in zip(gathered, sizes)])


def per_sequence_coefficients(token_coefficients: Tensor, loss_mask: Tensor) -> Tensor:
    """k_i such that d loss / d log pi_it = k_i on every loss token of row i (and 0 elsewhere).

    Book-keeping forms the update from whole-sequence gradients, so a loss whose token coefficients
    differ within a sequence is refused rather than trained on wrongly.
    """
    mask = loss_mask.to(token_coefficients.dtype)
    coefficients = (token_coefficients * mask).sum(1) / mask.sum(1).clamp(min=1)
    gap = (token_coefficients - coefficients.unsqueeze(1) * mask).abs().max()
    if gap > 1e-5 * coefficients.abs().max():
        raise RuntimeError(f"book-keeping needs one loss coefficient per sequence; tokens of a sequence differ by "
                           f"{float(gap):.3g} (use opob_impl: ghost for this loss)")
    return coefficients


def _config_values(config: Any) -> dict[str, Any]:
    if config is None:
        return {}
    from dataclasses import asdict

    return asdict(config)
