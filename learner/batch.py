"""The learner's view of rollouts: padded token tensors with behaviour log-probs aligned to targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass
class TrainBatch:
    """B sequences (prompt + completion) right-padded to L tokens.

    Target-aligned tensors have L - 1 columns: column t scores token t + 1 from the logits at t.
    `loss_mask` marks completion tokens, the only ones trained on.
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


def collate(samples: Sequence[dict[str, Any]], pad_token_id: int) -> TrainBatch:
    """Pad samples {prompt_ids, completion_ids, behaviour_logprobs, reward, group_id, version}.

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
        loss_mask[row, start : start + len(completion)] = True
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


def token_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) of each next token, [B, L-1], in fp32.

    The temperature matches the generator's processed log-probs, so on-policy ratios are 1.
    """
    logits = logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = input_ids[:, 1:].unsqueeze(-1)
    # log_softmax at the target = target logit - logsumexp, without materialising the full log-softmax
    return logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of the learner's next-token distribution softmax(logits / T) at each position, [B, L-1], fp32.

    One row at a time, so the extra softmax costs [L, V] of memory, not [B, L, V]; a policy whose entropy
    collapses stops exploring, the usual way GRPO runs stall.
    """
    rows = []
    for row in logits[:, :-1]:
        scaled = row.float() / temperature
        log_p = torch.log_softmax(scaled, dim=-1)
        rows.append(-(log_p.exp() * log_p).sum(dim=-1))
    return torch.stack(rows) if rows else logits.new_zeros(logits.shape[0], max(logits.shape[1] - 1, 0))


def sequence_logprob_grad(logits: Tensor, input_ids: Tensor, loss_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """d/d logits of sum of masked `token_logprobs`, [B, L, V] fp32: (onehot(next) - softmax(logits / T)) / T.

    Closed form, so a backward can start below the output layer (see learner/grad_norms.py).
    """
    scaled = logits[:, :-1].detach().float() / temperature
    grad = torch.softmax(scaled, dim=-1).neg_()
    grad.scatter_add_(-1, input_ids[:, 1:].unsqueeze(-1), torch.ones_like(grad[..., :1]))
    grad.mul_((loss_mask.float() / temperature).unsqueeze(-1))
    return torch.cat([grad, torch.zeros_like(grad[:, :1])], dim=1)
