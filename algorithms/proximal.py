"""The decoupled objective's trust region (AReaL's decoupled PPO; verl's recomputed old log-probs).

With `algorithm.proximal: recompute` a step has two policies to compare against. The behaviour policy
mu sampled the tokens, maybe several versions ago; the proximal policy pi_prox is the learner's own
policy at the start of the step, whose log-probs the learner computes once, without grad. The
stabilizer corrects the staleness pi_prox / mu as it always does; the trust region keeps each of the
step's updates near pi_prox:

    loss = -w_stabilizer * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A),  r = pi_theta / pi_prox

Its gradient is w_stabilizer * r * active * A * grad log pi_theta, so the trust region is one more
detached weight on the learner's single policy-gradient loss. At the step's first update pi_theta is
pi_prox: r = 1, nothing is clipped, and the update is the plain stabilized one.
"""

from __future__ import annotations

from torch import Tensor

from algorithms.batch import PolicyBatch, zero_where_set
from algorithms.clipping import clip_flags


def trust_region_weights(
    logprobs: Tensor, proximal_logprobs: Tensor, advantages: Tensor, mask: Tensor, eps_low: float, eps_high: float
) -> tuple[Tensor, Tensor]:
    """Detached weights r * active [B, T] of the clipped surrogate against pi_prox, and the float 0/1
    flags [B, T] of the loss tokens where the clip binds (no gradient).

    `logprobs` are pi_theta's now, `proximal_logprobs` pi_prox's for the same tokens; `advantages` are
    [B] or [B, T]; both weights and flags are 0 on padding.
    """
    trust = PolicyBatch(logprobs.detach(), proximal_logprobs, advantages, mask)
    clipped = clip_flags(trust.log_ratio, trust.advantages, trust.mask_float, 1.0 - eps_low, 1.0 + eps_high, None)
    flags = clipped.clone()
    return zero_where_set(trust.ratio, clipped), flags
