"""What one learner step is made of, apart from the rank that runs it: the per-row values a step fills in
(`StepValues`), a prompt group carried across micro-batches (`CarriedGroup`), and the pure helpers the
passes share (a run's sub-batch, the advantages, the whole-batch sequence metrics, book-keeping's per-sequence
coefficients, the forward without a padding mask). `learner/passes.py` runs the passes; nothing here is a
collective.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from algorithms.batch import TokenWeights
from algorithms.diagnostics import chi2_seq, ess_ratio
from algorithms.errors import StableAsyncError
from algorithms.stabilizer import Stabilizer
from learner.batch import TrainBatch
from learner.micro_batches import MicroBatch
from learner.vcpo.sample_gradients import SampleGradients


def sequence_metrics(global_log_w: Tensor) -> dict[str, Tensor]:
    """ESS ratio and sequence chi-square over the whole global batch (every rank's sequences)."""
    if global_log_w.numel() == 0:
        return {}
    return {"stability/ess_ratio": ess_ratio(global_log_w), "stability/chi2_seq": chi2_seq(global_log_w)}


def sub_batch(batch: TrainBatch, run: MicroBatch) -> TrainBatch:
    """The run's sub-batch without unused padding (its width known on the host); an empty run gives one row with
    nothing to train on, so that a rank with fewer micro-batches still joins every forward's collectives."""
    if run.rows is not None:
        return batch.rows(run.rows).trimmed(run.width)
    return batch.idle_row(run.width)


def step_advantages(
    stabilizer: Stabilizer,
    estimator: Callable[[Tensor, Tensor], Tensor],
    batch: TrainBatch,
    logprobs: Tensor,
    sample_grads: SampleGradients | None,
) -> tuple[Tensor, Tensor | None]:
    """The stabilizer's own advantages (VCPO's baseline), else the job's `estimator`; with the baseline when one
    was formed. Only a baseline reads the log-probs, and it needs the per-sample norms."""
    log_w = ((logprobs.detach() - batch.behaviour_logprobs) * batch.loss_mask).sum(dim=1)
    lengths = batch.loss_mask.sum(dim=1).float()
    grad_sq_norms = None if sample_grads is None else sample_grads.squared_norms
    own = stabilizer.advantages(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)
    if own is None:
        return estimator(batch.rewards, batch.group_ids), None
    if grad_sq_norms is None:
        return own, None
    return own, stabilizer.baseline(batch.rewards, log_w, grad_sq_norms, batch.group_ids, lengths)


def device_scalar(value: float, device: torch.device) -> Tensor:
    """A 0-dim fp32 tensor on the rank's `device` (a host tensor would cost a copy, or meet a device one)."""
    return torch.tensor(float(value), device=device)


@dataclass
class StepValues:
    """Per-row values of one step over the rank's batch, filled in micro-batch by micro-batch."""

    logprobs: Tensor  # [B, L-1] fp32: learner log-probs, detached
    entropy: Tensor  # [B, L-1] fp32: the learner's next-token entropy
    advantages: Tensor  # [B] fp32
    squared_norms: Tensor | None  # [B] fp32: ||grad log pi(tau_i)||^2, when the stabilizer needs them
    baseline: Tensor | None  # [B] fp32: VCPO's baseline, formed with the norms
    loss: Tensor  # [] fp32: this rank's share of the global loss, summed on the device (no host sync per micro-batch)
    decision: TokenWeights | None = None  # two passes: the stabilizer's decision on the whole batch
    skipped: bool = False  # non-finite values on some rank: no update
    bookkept_micro_batches: int = 0  # micro-batches whose update came from kept per-sample gradients
    folded_micro_batches: int = 0  # of those, the ones whose linear weights' per-sample gradients folded into sums
    carried_groups: int = 0  # prompt groups trained across micro-batches with a score buffer

    @classmethod
    def empty(cls, batch: TrainBatch, with_norms: bool) -> StepValues:
        zeros = batch.behaviour_logprobs.new_zeros
        norms = zeros(batch.size) if with_norms else None
        return cls(
            zeros(batch.loss_mask.shape),
            zeros(batch.loss_mask.shape),
            zeros(batch.size),
            norms,
            None if norms is None else zeros(batch.size),
            zeros(()),
        )

    def record(
        self,
        rows: Tensor,
        logprobs: Tensor,
        entropy: Tensor | None,
        advantages: Tensor | None,
        sample_grads: SampleGradients | None,
        baseline: Tensor | None,
    ) -> None:
        """One micro-batch's values (trimmed to its own width) into its rows."""
        width = logprobs.shape[1]
        self.logprobs[rows, :width] = logprobs.detach()
        if entropy is not None:
            self.entropy[rows, :width] = entropy.detach()
        if advantages is not None:
            self.advantages[rows] = advantages.float()
        if sample_grads is not None and self.squared_norms is not None:
            self.squared_norms[rows] = sample_grads.squared_norms.float()
        if baseline is not None and self.baseline is not None:
            self.baseline[rows] = baseline.float()

    def sample_grads(self) -> SampleGradients | None:
        return None if self.squared_norms is None else SampleGradients(self.squared_norms)


def affine_advantages(stabilizer: Stabilizer, batch: TrainBatch) -> tuple[Tensor, Tensor]:
    """[B] fp32 each: the advantages at baseline 0, and at_zero minus those at baseline 1 (a stabilizer whose
    advantages are affine in each group's baseline b: A = at_zero - b * slope)."""
    zeros = torch.zeros_like(batch.rewards, dtype=torch.float32)
    at_zero = stabilizer.advantages_from_baseline(batch.rewards, zeros, batch.group_ids)
    at_one = stabilizer.advantages_from_baseline(batch.rewards, zeros + 1, batch.group_ids)
    assert at_zero is not None and at_one is not None, "the stabilizer's advantages are affine in the baseline"
    return at_zero.float(), at_zero.float() - at_one.float()


@dataclass
class CarriedGroup:
    """A prompt group whose rows the plan split across consecutive micro-batches (nothing between them).

    A stabilizer's advantages are affine in the group's baseline b, A = A0 - b * slope (VCPO: A0 = R / sigma,
    slope = 1 / sigma), and the loss is linear in A. So the group's gradient is grad loss(A0) - b * grad
    loss(slope): the first joins the engine's accumulation piece by piece, the second waits in `score`
    until the last piece gives the per-sample norms that b needs.
    """

    rows: Tensor  # [n] long: all the group's rows in the rank's batch
    at_zero: Tensor  # [B] fp32: the rank's advantages at baseline 0
    slope: Tensor  # [B] fp32: at_zero minus the advantages at baseline 1
    score: dict[torch.nn.Parameter, Tensor] | None = None  # fp32, per parameter: sum over seen rows of grad slope
    slope_loss: Tensor | float = 0.0  # the pieces' loss at advantages `slope`
    seen: int = 0  # rows of the group passed so far

    @classmethod
    def start(cls, stabilizer: Stabilizer, batch: TrainBatch, rows: Tensor) -> CarriedGroup:
        at_zero, slope = affine_advantages(stabilizer, batch)
        return cls(rows, at_zero, slope)

    def add(self, piece_rows: int, score: dict[torch.nn.Parameter, Tensor], slope_loss: Tensor) -> None:
        """A piece's gradient of the slope loss, into the buffer."""
        self.seen += piece_rows
        if self.score is None:
            self.score = score
        else:
            for param, grad in score.items():
                self.score[param].add_(grad)
        self.slope_loss += slope_loss

    @property
    def complete(self) -> bool:
        """Whether every row of the group has passed (the piece just added was the last)."""
        return self.seen == len(self.rows)

    def close(self, grads: dict[torch.nn.Parameter, Tensor], baseline: Tensor) -> dict[torch.nn.Parameter, Tensor]:
        """The last piece's gradient minus b times the score buffer, which is then released."""
        score = self.score
        assert score is not None, "a carried group closes after its pieces were added"
        out = {param: (grad.float() - baseline * score[param]).to(grad.dtype) for param, grad in grads.items()}
        self.score = None
        return out


class NonFiniteUpdate(StableAsyncError, ArithmeticError):
    """A decoupled update's loss was not finite on some rank (every rank raises it at the same micro-batch)."""

    def __init__(self, micro_batch: int) -> None:
        super().__init__(f"non-finite loss at micro-batch {micro_batch}")
        self.micro_batch = micro_batch


def causal_logits(model: Any, batch: TrainBatch) -> Tensor:
    """[B, L, V] logits of right-padded rows, without an attention mask: under the causal mask no real token
    attends to the padding after it, and positions count from 0 either way, so every real position's logits
    are the masked forward's. Without a padding mask the attention takes its causal kernel (flash attention
    on a GPU) and the model builds no mask, which costs a host sync (transformers checks the mask on the host).
    """
    return model(input_ids=batch.input_ids).logits


def prompt_group_shares(group_ids: Tensor, shares: int) -> list[Tensor]:
    """[b] row indices of `shares` runs of consecutive whole prompt groups, as even as the groups allow."""
    groups = torch.unique(group_ids)
    if len(groups) < shares:
        raise ValueError(
            f"{shares} mini-batches need at least as many prompt groups per rank, got {len(groups)} "
            "(learner.mini_batches)"
        )
    return [torch.isin(group_ids, part).nonzero().flatten() for part in groups.tensor_split(shares)]


def rows_of(reference: Tensor | None, rows: Tensor | None, logprobs: Tensor) -> Tensor | None:
    """The reference log-probs of a micro-batch's rows, trimmed to its width; an empty micro-batch's own
    log-probs (a KL of 0 on its empty mask)."""
    if reference is None:
        return None
    return logprobs.detach() if rows is None else reference[rows, : logprobs.shape[1]]


# How far a sequence's token coefficients may differ, relative to the largest, and still be one coefficient.
COEFFICIENT_GAP_TOLERANCE = 1e-5


def sequence_coefficients(token_coefficients: Tensor, loss_mask: Tensor) -> tuple[Tensor, Tensor]:
    """k_i such that d loss / d log pi_it = k_i on every loss token of row i (and 0 elsewhere), and the
    largest difference of a token's coefficient from its row's k_i relative to the largest |k_i|: a
    device scalar, so the caller checks it once per step instead of syncing per micro-batch."""
    mask = loss_mask.to(token_coefficients.dtype)
    coefficients = (token_coefficients * mask).sum(1) / mask.sum(1).clamp(min=1)
    gap = (token_coefficients - coefficients.unsqueeze(1) * mask).abs().max()
    return coefficients, gap / coefficients.abs().max().clamp(min=torch.finfo(coefficients.dtype).tiny)


def check_one_coefficient_per_sequence(gap: float) -> None:
    """Refuse a loss whose token coefficients differ within a sequence (`sequence_coefficients`' gap):
    book-keeping forms the update from whole-sequence gradients, so such a loss would be trained on wrongly."""
    if gap > COEFFICIENT_GAP_TOLERANCE:
        raise RuntimeError(
            f"book-keeping needs one loss coefficient per sequence; tokens of a sequence differ by "
            f"{gap:.3g} of the largest (use opob_impl: ghost for this loss)"
        )
