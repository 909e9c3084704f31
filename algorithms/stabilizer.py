"""The stabilizer contract (CONTRIBUTING.md, "Checklist: adding a stabilizer") and the decorator that registers an
implementation by name."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, ClassVar, TypeVar

from torch import Tensor

from algorithms.batch import PolicyBatch, TokenWeights
from algorithms.config import STABILIZER_CONFIGS


class Stabilizer:
    """Base class: per-token weights and masks, plus optional LR scale and baseline.

    Subclasses set `name` and implement `token_weights`. A stabilizer whose `baseline` needs
    per-sample gradient norms sets `needs_grad_norms = True`; the learner then provides them.
    """

    name: ClassVar[str] = ""
    decides_per_row: ClassVar[bool] = False
    """True when `token_weights` of any set of whole rows is the whole batch's decision on those rows and
    keeps the batch's loss mask (so the loss denominator is known before any forward): the learner then
    decides per micro-batch, one forward each. False (M2PO's trust region, BAPO's bounds, MIS masks that
    change the denominator) costs the learner a no-grad pass over the batch first."""

    def __init__(self, config: Any | None = None) -> None:
        config_cls = STABILIZER_CONFIGS[self.name]
        self.config = config if config is not None else config_cls()
        if not isinstance(self.config, config_cls):
            raise TypeError(f"stabilizer {self.name!r} takes {config_cls.__name__}, got {type(self.config).__name__}")

    @property
    def needs_grad_norms(self) -> bool:
        """Whether `baseline` needs per-sample squared gradient norms |grad log pi(tau_i)|^2."""
        return False

    def token_weights(self, batch: PolicyBatch) -> TokenWeights:
        """Detached per-token weights [B, T], the loss mask and this stabilizer's metrics."""
        raise NotImplementedError

    def global_metrics(self, log_w: Tensor) -> dict[str, Tensor]:
        """Metrics of the whole global batch's sequence log-weights (all ranks), logged every step."""
        return {}

    def lr_scale(self, log_w: Tensor) -> float:
        """Factor on the learning rate for this step, from the global batch's sequence log-weights."""
        return 1.0

    def baseline(
        self, rewards: Tensor, log_w: Tensor, grad_sq_norms: Tensor | None, group_ids: Tensor, token_lengths: Tensor
    ) -> Tensor | None:
        """Per-sample baseline replacing the group mean, or None to keep the job's advantage estimator."""
        return None

    def advantages(
        self, rewards: Tensor, log_w: Tensor, grad_sq_norms: Tensor | None, group_ids: Tensor, token_lengths: Tensor
    ) -> Tensor | None:
        """Advantages built on `baseline`, or None to keep the job's advantage estimator."""
        return None

    def advantages_from_baseline(self, rewards: Tensor, baseline: Tensor, group_ids: Tensor) -> Tensor | None:
        """The advantages `advantages` forms from a given per-sample `baseline`, affine in it, or None.

        With this (and `token_weights` that do not read the advantages) the learner can train a prompt
        group split across micro-batches in one forward each: it accumulates the gradients of the
        parts with baseline 0 and with baseline 1, and combines them once the group's baseline is known.
        """
        return None

    def __repr__(self) -> str:
        values = ", ".join(f"{f.name}={getattr(self.config, f.name)!r}" for f in fields(self.config))
        return f"{type(self).__name__}({values})"


REGISTRY: dict[str, type[Stabilizer]] = {}

S = TypeVar("S", bound=type[Stabilizer])


def register(name: str) -> Callable[[S], S]:
    """Class decorator: make a stabilizer selectable by `algorithm.stabilizer.name`."""

    def wrap(cls: S) -> S:
        if name in REGISTRY:
            raise ValueError(f"stabilizer {name!r} is registered twice")
        if name not in STABILIZER_CONFIGS:
            raise ValueError(f"stabilizer {name!r} has no config in algorithms.config.STABILIZER_CONFIGS")
        cls.name = name
        REGISTRY[name] = cls
        return cls

    return wrap
