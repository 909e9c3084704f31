"""The learner's view of rollouts: padded token tensors with behaviour log-probs aligned to targets."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from learner.records import TrainingSample


@dataclass
class TrainBatch:
    """B sequences (prompt + completion) right-padded to L tokens.

    Target-aligned tensors have L - 1 columns: column t scores token t + 1 from the logits at t.
    `loss_mask` marks the completion tokens the policy sampled, the only ones trained on (an episode's tool
    results are completion tokens off the mask).
    """

    input_ids: Tensor  # [B, L] long
    attention_mask: Tensor  # [B, L] long
    loss_mask: Tensor  # [B, L-1] bool
    behaviour_logprobs: Tensor  # [B, L-1] float32, 0 off the loss mask
    rewards: Tensor  # [B] float32
    group_ids: Tensor  # [B] long: responses to one prompt share an id
    versions: Tensor  # [B] long: policy version the response was sampled with (start)

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def rows(self, index: Tensor) -> TrainBatch:
        """The sub-batch of the given rows."""
        return TrainBatch(*(getattr(self, f)[index] for f in self.__dataclass_fields__))

    def idle_row(self, width: int | None = None) -> TrainBatch:
        """Its first row with nothing to train on (no loss token): for a rank that joins a step's collectives
        without a micro-batch, or without a group, of its own."""
        idle = self.rows(torch.zeros(1, dtype=torch.long, device=self.input_ids.device)).trimmed(width)
        idle.loss_mask = torch.zeros_like(idle.loss_mask)
        idle.behaviour_logprobs = torch.zeros_like(idle.behaviour_logprobs)
        return idle

    @property
    def sequence_lengths(self) -> Tensor:
        """Real (unpadded) tokens of each sequence, [B] long."""
        return self.attention_mask.sum(dim=1)

    def trimmed(self, width: int | None = None) -> TrainBatch:
        """The same rows without the padding columns that no row of this batch uses: `width` columns when the
        caller knows its longest row on the host (reading it from the device would wait for the device)."""
        if width is None:
            width = max(2, int(self.sequence_lengths.max())) if self.size else 2
        return TrainBatch(
            self.input_ids[:, :width],
            self.attention_mask[:, :width],
            self.loss_mask[:, : width - 1],
            self.behaviour_logprobs[:, : width - 1],
            self.rewards,
            self.group_ids,
            self.versions,
        )

    def to(self, device: torch.device | str) -> TrainBatch:
        """Every tensor on `device` (the rank's): the model and the collectives see one device."""
        return TrainBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def rank_share_sizes(groups: int, ranks: int) -> list[int]:
    """How many of a step's prompt groups each rank takes, in order: as even as whole groups go, the first
    `groups % ranks` ranks one more. A short batch (`async.fixed_lag` does not replace a dropped group) still
    trains every group; with fewer groups than ranks, the last ranks take none."""
    per_rank, extra = divmod(groups, ranks)
    return [per_rank + (rank < extra) for rank in range(ranks)]


def rank_shards(groups: Sequence[Sequence[TrainingSample]], ranks: int, pad_token_id: int) -> list[TrainBatch]:
    """Each rank's training batch of whole prompt groups (group statistics stay on one rank), split by
    `rank_share_sizes`; a rank that takes none gets a row with nothing to train on (`TrainBatch.idle_row`), to
    join the step's collectives."""
    if not groups:
        raise ValueError("a step needs at least one prompt group")
    sizes = rank_share_sizes(len(groups), ranks)
    shards = [
        collate([s for group in groups[end - size : end] for s in group], pad_token_id) if size else None
        for end, size in zip(itertools.accumulate(sizes), sizes)
    ]
    first = shards[0]
    assert first is not None, "the first rank takes a group whenever there is one"
    return [first.idle_row() if shard is None else shard for shard in shards]


def collate(samples: Sequence[TrainingSample], pad_token_id: int) -> TrainBatch:
    """Pad training samples into one batch.

    Filled in numpy and handed to torch without a copy: the driver collates every step, and numpy
    takes a Python list into a row slice several times faster than a torch.tensor per row.
    """
    if not samples:
        raise ValueError("cannot collate an empty list of samples")
    lengths = [len(s["prompt_ids"]) + len(s["completion_ids"]) for s in samples]
    width = max(lengths)
    batch = len(samples)
    input_ids = np.full((batch, width), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((batch, width), dtype=np.int64)
    loss_mask = np.zeros((batch, width - 1), dtype=np.bool_)
    behaviour = np.zeros((batch, width - 1), dtype=np.float32)
    for row, sample in enumerate(samples):
        prompt, completion = sample["prompt_ids"], sample["completion_ids"]
        if len(sample["behaviour_logprobs"]) != len(completion):
            raise ValueError(
                f"sample {row} (group {sample['group_id']}): {len(completion)} completion tokens but "
                f"{len(sample['behaviour_logprobs'])} behaviour log-probs"
            )
        input_ids[row, : len(prompt)] = prompt
        input_ids[row, len(prompt) : lengths[row]] = completion
        attention_mask[row, : lengths[row]] = 1
        start = len(prompt) - 1  # logits at the last prompt token score the first completion token
        policy_mask = sample.get("policy_mask")
        if policy_mask is None:
            loss_mask[row, start : start + len(completion)] = True
        elif len(policy_mask) != len(completion):
            raise ValueError(
                f"sample {row} (group {sample['group_id']}): {len(completion)} completion tokens but "
                f"a policy mask of {len(policy_mask)}"
            )
        else:  # tool results are context only: off the loss, every importance ratio and the ESS
            loss_mask[row, start : start + len(completion)] = np.asarray(policy_mask, dtype=np.bool_)
        behaviour[row, start : start + len(completion)] = sample["behaviour_logprobs"]
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=torch.from_numpy(attention_mask),
        loss_mask=torch.from_numpy(loss_mask),
        behaviour_logprobs=torch.from_numpy(behaviour),
        rewards=torch.tensor([float(s["reward"]) for s in samples], dtype=torch.float32),
        group_ids=torch.tensor([int(s["group_id"]) for s in samples], dtype=torch.long),
        versions=torch.tensor([int(s["version"]) for s in samples], dtype=torch.long),
    )


# Positions x vocabulary entries of one fp32 chunk of logits: the largest fp32 [*, V] temporary the
# log-softmax makes (64 MiB; 341 positions of SmolLM2's 49k vocabulary, 110 of a 152k one).
CHUNK_LOGIT_ELEMENTS = 1 << 24


def position_chunks(positions: int, vocab: int) -> Iterator[slice]:
    """Slices of positions whose [*, vocab] fp32 copy holds at most CHUNK_LOGIT_ELEMENTS numbers."""
    size = max(1, CHUNK_LOGIT_ELEMENTS // max(1, vocab))
    for start in range(0, positions, size):
        yield slice(start, min(start + size, positions))


class _TargetLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] and the entropy of softmax(logits / T) per position, upcast to fp32 one
    chunk of positions at a time; both differentiable.

    Autograd of `logsumexp(logits.float())` would keep an fp32 copy of every chunk until the backward;
    this keeps only the logits themselves (in the model's dtype) and the [N] log-normalisers and entropies,
    and the backward rebuilds each chunk's softmax. The entropy costs one more exp per chunk, so it is
    computed only when asked for.
    """

    @staticmethod
    def forward(
        ctx,
        logits: Tensor,
        targets: Tensor,
        temperature: float,  # logits [N, V], targets [N]
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        logprobs = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        normalisers = torch.empty_like(logprobs)
        entropy = torch.empty_like(logprobs) if with_entropy else logprobs.new_zeros(0)
        for rows in position_chunks(*logits.shape):
            chunk = logits[rows].float() / temperature
            normalisers[rows] = torch.logsumexp(chunk, dim=-1)
            logprobs[rows] = chunk.gather(-1, targets[rows, None]).squeeze(-1) - normalisers[rows]
            if with_entropy:
                log_p = chunk.sub_(normalisers[rows, None])
                entropy[rows] = -(log_p.exp() * log_p).sum(dim=-1)
        ctx.save_for_backward(logits, targets, normalisers, entropy)
        ctx.temperature = temperature
        return logprobs, entropy

    @staticmethod
    def backward(
        ctx, grad_logprobs: Tensor | None, grad_entropy: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        """d logp[target]/dx = onehot - p and dH/dx = -p (log p + H), with x = logits / T."""
        logits, targets, normalisers, entropy = ctx.saved_tensors
        temperature = ctx.temperature
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None
        grad_logits = torch.empty_like(logits)
        for rows in position_chunks(*logits.shape):
            log_p = logits[rows].float() / temperature - normalisers[rows, None]
            grad_logits[rows] = chunk_logits_gradient(
                log_p,
                targets[rows],
                entropy[rows] if entropy.numel() else None,
                None if grad_logprobs is None else grad_logprobs[rows],
                None if grad_entropy is None else grad_entropy[rows],
                temperature,
            )
        return grad_logits, None, None, None


def chunk_logits_gradient(
    log_p: Tensor,
    targets: Tensor,
    entropy: Tensor | None,
    grad_logprobs: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """d/d logits of sum_t g_t log p_t[target_t] + e_t H_t for one chunk of positions, from its log-softmax
    `log_p` [n, V] (consumed): d logp[target]/dx = onehot - p and dH/dx = -p (log p + H), with x = logits / T."""
    chunk = torch.zeros_like(log_p)
    if grad_entropy is not None and entropy is not None:
        chunk.add_(log_p + entropy[:, None]).mul_(-grad_entropy[:, None])
    if grad_logprobs is not None:
        chunk.sub_(grad_logprobs[:, None])
    chunk.mul_(log_p.exp_()).div_(temperature)
    if grad_logprobs is not None:  # d/dx of x[target]: + g / T
        chunk.scatter_add_(-1, targets[:, None], (grad_logprobs / temperature).unsqueeze(-1))
    return chunk


def next_tokens(input_ids: Tensor) -> Tensor:
    """[B * L] each position's next token, the last position of a row scored against a dummy (its row's first
    token) so that a [B, L, ...] tensor of the positions stays a view; `position_scales` gives that one 0."""
    return torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1).reshape(-1)


def position_scales(loss_mask: Tensor, temperature: float) -> Tensor:
    """[B * L] fp32 d log p[next] / d (logits / T) over d logits at each position: its loss mask over T, and 0
    at each row's last position (`next_tokens`' dummy)."""
    scale = torch.cat([loss_mask.float(), loss_mask.new_zeros(loss_mask.shape[0], 1, dtype=torch.float32)], dim=1)
    return scale.reshape(-1).div_(temperature)


def _chunked(logits: Tensor, input_ids: Tensor, temperature: float, with_entropy: bool) -> tuple[Tensor, Tensor]:
    batch, length, vocab = logits.shape
    targets = next_tokens(input_ids)  # the logits stay a view
    logprobs, entropy = _TargetLogprobs.apply(
        logits.reshape(batch * length, vocab), targets, float(temperature), with_entropy
    )
    entropy = entropy.view(batch, length)[:, :-1] if with_entropy else entropy
    return logprobs.view(batch, length)[:, :-1], entropy


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) of each next token, [B, L-1], in fp32.

    The temperature matches the generator's processed log-probs, so on-policy ratios are 1. The fp32
    upcast happens one chunk of positions at a time, in the forward and in the backward.
    """
    return _chunked(logits, input_ids, temperature, with_entropy=False)[0]


def token_logprobs_and_entropy(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
    """`token_logprobs` and the entropy of softmax(logits / T) at each position, both [B, L-1] fp32 and both
    differentiable (the entropy bonus trains on it), from one chunked pass over the logits."""
    return _chunked(logits, input_ids, temperature, with_entropy=True)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the learner's next-token distribution softmax(logits / T) at each position, [B, L-1], fp32.

    One chunk of positions at a time, so the extra softmax never costs more than one fp32 chunk; a policy
    whose entropy collapses stops exploring, the usual way GRPO runs stall.
    """
    return _chunked(
        logits, torch.zeros(logits.shape[:2], dtype=torch.long, device=logits.device), temperature, with_entropy=True
    )[1]


def sequence_logprob_grad(logits: Tensor, input_ids: Tensor, loss_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """d/d logits of sum of masked `token_logprobs`, [B, L, V] in the logits' dtype:
    (onehot(next) - softmax(logits / T)) / T.

    Closed form, so a backward can start below the output layer (see learner/vcpo/ghost_norms.py). Each chunk of
    positions is formed in fp32 and written into the result, which stays in the model's dtype so that the
    products that consume it run on tensor cores.
    """
    batch, length, vocab = logits.shape
    grad = torch.empty(batch, length, vocab, dtype=logits.dtype, device=logits.device)
    flat_logits, flat_grad = logits.detach().reshape(batch * length, vocab), grad.view(batch * length, vocab)
    targets = next_tokens(input_ids)
    scale = position_scales(loss_mask, temperature)[:, None]  # 0 off the loss mask and at each row's last position
    for rows in position_chunks(*flat_logits.shape):
        chunk = torch.softmax(flat_logits[rows].float() / temperature, dim=-1).neg_()
        chunk.scatter_add_(-1, targets[rows, None], torch.ones_like(chunk[:, :1]))
        flat_grad[rows] = chunk.mul_(scale[rows])
    return grad
