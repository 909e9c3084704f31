"""The step's loss beyond the policy gradient, and the KL to the reference where the job has one: the KL term
and the entropy bonus in the loss (`kl in: loss`), the KL penalty in the reward (`kl in: reward`), and the KL
metrics. Pure functions of the job's learner spec and the step's KL coefficient (an adaptive one moves each
step, `LearnerStep.kl_coef`)."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from algorithms.aggregation import aggregate_token_loss, policy_loss
from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.regularizers import kl_penalty, sequence_kl
from learner.batch import TrainBatch
from learner.spec import LearnerSpec
from learner.step import device_scalar


def step_loss(
    spec: LearnerSpec,
    kl_coef: float,
    policy: PolicyBatch,
    decision: TokenWeights,
    denominator: Tensor,
    entropy: Tensor | None,
    reference: Tensor | None,
) -> Tensor:
    """The policy-gradient loss, plus the KL term to the reference and minus the entropy bonus when the job
    has them: all three aggregated over the decision's mask with one denominator. Every pass calls it."""
    loss = policy_loss(policy, decision, spec.loss_aggregation, denominator, spec.constant_tokens)
    mask = policy.mask_float if decision.mask is policy.mask else decision.mask
    terms: list[Tensor] = []
    if reference is not None and spec.kl_in == "loss":
        terms.append(kl_coef * kl_penalty(policy.logprobs, reference, spec.kl_estimator, mask))
    if spec.entropy_coef:
        assert entropy is not None, "an entropy bonus is formed from the entropy"
        terms.append(-spec.entropy_coef * entropy)
    if not terms:
        return loss
    return loss + aggregate_token_loss(
        sum(terms[1:], terms[0]), mask, spec.loss_aggregation, denominator, spec.constant_tokens
    )


def kl_in_reward(
    spec: LearnerSpec, kl_coef: float, batch: TrainBatch, reference: Tensor | None
) -> tuple[TrainBatch, dict[str, Tensor]]:
    """With `kl in: reward`, the batch whose rewards lose coef x the sampled response's summed KL to the
    reference, from the behaviour log-probs the sampler recorded (known before the step, as verl's
    in-reward penalty uses the rollout's); otherwise the batch as it is."""
    if reference is None or spec.kl_in != "reward":
        return batch, {}
    penalty = kl_coef * sequence_kl(batch.behaviour_logprobs, reference, batch.loss_mask, spec.kl_estimator)
    shaped = replace(batch, rewards=batch.rewards - penalty)
    return shaped, {"rollout/kl_ref_penalty_mean": penalty.mean()}


def kl_metrics(
    spec: LearnerSpec, kl_coef: float, batch: TrainBatch, logprobs: Tensor, reference: Tensor | None
) -> dict[str, Tensor]:
    """The KL per loss token of the learner at the step's start to the reference, and the coefficient."""
    if reference is None:
        return {}
    tokens = kl_penalty(logprobs, reference, spec.kl_estimator, batch.loss_mask)
    return {
        "stability/kl_ref_mean": tokens.sum() / batch.loss_mask.sum().clamp(min=1),
        "stability/kl_ref_coef": device_scalar(kl_coef, logprobs.device),
    }
